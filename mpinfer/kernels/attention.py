"""Decode attention with ALiBi in one Triton kernel: write this step's K/V into the cache and
attend over the slot's history, for one query token per row.

    qkv (B, heads_per_rank * 3 * head_dim)   the fused QKV output, laid out [heads, 3, head_dim]
    k_cache, v_cache (slots, heads_per_rank, max_seq, head_dim)
    slot_ids, positions, valid_from (B,)     row b writes at positions[b] of slot slot_ids[b]
                                             and attends to [valid_from[b], positions[b]]
    slopes (heads_per_rank,) fp32            this rank's ALiBi slopes
    out (B, heads_per_rank * head_dim)       ready for the dense (row-parallel) layer

Program (b, h) streams the slot's keys and values in BLOCK_L tiles with an online softmax in
fp32; the new token's key and value come straight from qkv (so no read-after-write of the
cache inside the program). One launch replaces the view/unbind, two index_puts, the mask and
bias build, SDPA and the transpose copy of the eager path (reference: model.BloomAttention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(
    qkv_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, pos_ptr, vf_ptr, slope_ptr,
    stride_qkv, stride_cs, stride_ch, stride_cl, stride_out, scale,
    HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + b)
    pos = tl.load(pos_ptr + b)
    vf = tl.load(vf_ptr + b)
    slope = tl.load(slope_ptr + h)
    d = tl.arange(0, HEAD_DIM)
    base = qkv_ptr + b * stride_qkv + h * 3 * HEAD_DIM
    q = tl.load(base + d).to(tl.float32)
    k_new = tl.load(base + HEAD_DIM + d)
    v_new = tl.load(base + 2 * HEAD_DIM + d)
    cache_off = slot.to(tl.int64) * stride_cs + h * stride_ch
    tl.store(k_ptr + cache_off + pos * stride_cl + d, k_new)
    tl.store(v_ptr + cache_off + pos * stride_cl + d, v_new)

    # The new token first: it is always attended to (its distance to itself is pos - vf).
    m = tl.sum(q * k_new.to(tl.float32)) * scale + slope * (pos - vf).to(tl.float32)
    denom = 1.0
    acc = v_new.to(tl.float32)
    offs = tl.arange(0, BLOCK_L)
    for start in tl.range(vf, pos, BLOCK_L):
        j = start + offs  # (BLOCK_L,) key positions
        ok = j < pos
        kv_off = cache_off + j[:, None].to(tl.int64) * stride_cl + d[None, :]
        keys = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.sum(keys * q[None, :], axis=1) * scale + slope * (j - vf).to(tl.float32)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        vals = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vals, axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / denom
    tl.store(out_ptr + b * stride_out + h * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    valid_from: torch.Tensor,
    slopes: torch.Tensor,
) -> torch.Tensor:
    B = qkv.shape[0]
    heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty((B, heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    _decode_attention_kernel[(B, heads)](
        qkv, k_cache, v_cache, out, slot_ids, positions, valid_from, slopes,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        head_dim**-0.5, HEAD_DIM=head_dim, BLOCK_L=64, num_warps=4,
    )  # fmt: skip
    return out
