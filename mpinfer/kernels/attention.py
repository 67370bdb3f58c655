"""Decode attention with ALiBi in one Triton kernel: write this step's K/V into the cache and
attend over the slot's history, for one query token per row.

    qkv (B, heads_per_rank * 3 * head_dim)   the fused QKV output, laid out [heads, 3, head_dim]
    k_cache, v_cache (slots, heads_per_rank, max_seq, head_dim)
    slot_ids, positions, valid_from (B,)     row b writes at positions[b] of slot slot_ids[b]
                                             and attends to [valid_from[b], positions[b]];
                                             a row of slot -1 (padding) does neither: zeros out
    slopes (heads_per_rank,) fp32            this rank's ALiBi slopes
    out (B, heads_per_rank * head_dim)       ready for the dense (row-parallel) layer

Flash-decoding: program (b, h, s) streams split s of the row's keys and values (the history
cut into n_splits equal runs of BLOCK_L-key tiles at run time) with an online softmax in fp32,
and a second kernel merges the splits; batch 1 with 32 heads still fills the GPU. Tiles of 32
keys with 2 warps per program beat 64 keys with 4 by 1.3-1.5x at every batch on the H200
(docs/performance.md). The new token's key and value come straight
from qkv (no read-after-write of the cache inside a program). Two launches replace the
view/unbind, two index_puts, the mask and bias build, SDPA and the transpose copy of the eager
path (the reference: model.BloomAttention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import attention_splits, sm_count

# Keys per tile, warps and pipeline stages per program (the sweep's winner; stages made no
# difference there).
TILE_KEYS, WARPS, STAGES = 32, 2, 3


@triton.jit
def _decode_attention_kernel(
    qkv_ptr, k_ptr, v_ptr, ws_ptr, slot_ptr, pos_ptr, vf_ptr, slope_ptr,
    stride_qkv, stride_cs, stride_ch, stride_cl, scale, n_heads, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """Program (b, h, s): split s of the keys [vf, pos) of row b, cut into n_splits equal runs
    of whole BLOCK_L tiles at run time (the row's length is known only on the device, so a
    captured graph serves every length), and (s == 0) the new token at pos. Writes its partial
    softmax state (max, sum, weighted values) to the workspace."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    slot_in = tl.load(slot_ptr + b)
    live = slot_in >= 0  # slot -1: a padding row of a captured bucket, it reads and writes nothing
    slot = tl.maximum(slot_in, 0)
    pos = tl.load(pos_ptr + b)
    vf = tl.load(vf_ptr + b)
    slope = tl.load(slope_ptr + h)
    d = tl.arange(0, HEAD_DIM)
    base = qkv_ptr + b * stride_qkv + h * 3 * HEAD_DIM
    q = tl.load(base + d).to(tl.float32)
    cache_off = slot.to(tl.int64) * stride_cs + h * stride_ch
    m = -float("inf")
    denom = 0.0
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    if s == 0:
        k_new = tl.load(base + HEAD_DIM + d)
        v_new = tl.load(base + 2 * HEAD_DIM + d)
        write = (d * 0 + slot_in) >= 0  # (HEAD_DIM,): every lane of a live row
        tl.store(k_ptr + cache_off + pos * stride_cl + d, k_new, mask=write)
        tl.store(v_ptr + cache_off + pos * stride_cl + d, v_new, mask=write)
        m_new_token = tl.sum(q * k_new.to(tl.float32)) * scale + slope * (pos - vf).to(tl.float32)
        m = tl.where(live, m_new_token, -float("inf"))
        denom = tl.where(live, 1.0, 0.0)
        acc = tl.where(live, v_new.to(tl.float32), 0.0)
    per_split = tl.cdiv(tl.cdiv(pos - vf, n_splits), BLOCK_L) * BLOCK_L
    lo = vf + s * per_split
    hi = tl.minimum(lo + per_split, pos)  # a padding row has pos = vf = 0: no tile at all
    offs = tl.arange(0, BLOCK_L)
    for start in tl.range(lo, hi, BLOCK_L):
        j = start + offs  # (BLOCK_L,) key positions
        ok = j < hi
        kv_off = cache_off + j[:, None].to(tl.int64) * stride_cl + d[None, :]
        keys = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
        vals = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
        sc = tl.sum(keys * q[None, :], axis=1) * scale + slope * (j - vf).to(tl.float32)
        sc = tl.where(ok, sc, -float("inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * vals, axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    ws = ws_ptr + ((b * n_heads + h) * n_splits + s) * (HEAD_DIM + 2)
    tl.store(ws + d, acc)
    tl.store(ws + HEAD_DIM, m)
    tl.store(ws + HEAD_DIM + 1, denom)


@triton.jit
def _combine_kernel(ws_ptr, out_ptr, stride_out, n_heads, n_splits,
                    HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr):  # fmt: skip
    """Program (b, h): merge the splits' partial softmax states into the output."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM)
    ws = ws_ptr + (b * n_heads + h) * n_splits * (HEAD_DIM + 2)
    ok = sp < n_splits
    m = tl.load(ws + sp * (HEAD_DIM + 2) + HEAD_DIM, mask=ok, other=-float("inf"))
    den = tl.load(ws + sp * (HEAD_DIM + 2) + HEAD_DIM + 1, mask=ok, other=0.0)
    acc = tl.load(ws + sp[:, None] * (HEAD_DIM + 2) + d[None, :], mask=ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(den > 0, tl.exp(m - m_all), 0.0)  # empty splits (m = -inf) weigh nothing
    total = tl.sum(den * w, axis=0)
    # A padding row has no split with weight: its output is zeros, not 0/0.
    out = tl.where(total > 0, tl.sum(acc * w[:, None], axis=0) / total, 0.0)
    tl.store(out_ptr + b * stride_out + h * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    valid_from: torch.Tensor,
    slopes: torch.Tensor,
    *,
    n_splits: int | None = None,
    block_l: int = TILE_KEYS,
    num_warps: int = WARPS,
    num_stages: int = STAGES,
) -> torch.Tensor:
    """n_splits (programs per row and head) by default from the policy in
    tuning.attention_splits; the keyword arguments are for benchmarks and tests."""
    B = qkv.shape[0]
    heads, max_seq, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    if n_splits is None:
        n_splits = attention_splits(B, heads, max_seq, sm_count(qkv.device.index))
    ws = torch.empty((B, heads, n_splits, head_dim + 2), dtype=torch.float32, device=qkv.device)
    out = torch.empty((B, heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    _decode_attention_kernel[(B, heads, n_splits)](
        qkv, k_cache, v_cache, ws, slot_ids, positions, valid_from, slopes,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        head_dim**-0.5, heads, n_splits,
        HEAD_DIM=head_dim, BLOCK_L=block_l, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _combine_kernel[(B, heads)](
        ws, out, out.stride(0), heads, n_splits,
        HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(n_splits), num_warps=2,
    )  # fmt: skip
    return out
