"""Attention with ALiBi over the block-table KV cache, in Triton: one query token per row
(decode), and tiles of prompt-chunk queries (prefill), both reading the same cache layout.

    qkv (N, heads_per_rank * 3 * head_dim)   the fused QKV output, laid out [heads, 3, head_dim]
    k_cache, v_cache (blocks, heads_per_rank, block_size, head_dim)
    tables (rows, blocks_per_row)            position p of cache row r is at offset
                                             p % block_size of block tables[r, p // block_size]
    slopes (heads_per_rank,) fp32            this rank's ALiBi slopes

`decode_attention`: row b of qkv is the new token of cache row seq[b] at positions[b]; it writes
its key and value and attends to [valid_from[b], positions[b]]; a row of seq -1 (padding) does
neither: zeros out. Flash-decoding: program (b, h, s) streams split s of the row's keys and
values (the history cut into n_splits equal runs of BLOCK_L-key tiles at run time) with an online
softmax in fp32, and a second kernel merges the splits; batch 1 with 32 heads still fills the
GPU. Tiles of 32 keys with 2 warps per program beat 64 keys with 4 by 1.3-1.5x at every batch on
the H200 (docs/performance.md). The new token's key and value come straight from qkv (no
read-after-write of the cache inside a program).

`store_kv` + `chunk_attention`: the prompt chunks of a step. The first writes every token's key
and value into the cache (tokens of row -1 write nothing); the second runs program (tile, h)
over one tile of up to BLOCK_M consecutive query tokens of one chunk (tile = cache row, first
token, token count, first position; a count of 0 is an unused tile of a captured bucket), with
tensor-core products of the tile's queries against BLOCK_N-key tiles of [0, last position] and a
causal mask. Both are launched over fixed grids, so a CUDA graph serves every mix of chunks up to
its bucket's size. The eager reference of all three: attention.py (the model layer).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED
from .tuning import CHUNK_TILE, attention_splits, sm_count
from .w8a16_convert import _to_compute


@triton.jit
def _quantize(x):
    """(HEAD_DIM,) fp32 -> the int8 values (still fp32, in [-127, 127]) and their scale: the
    row's largest magnitude / 127 (attention.quantize_kv is the reference)."""
    s = tl.maximum(tl.max(tl.abs(x), axis=0) / 127.0, 1e-8)
    return tl.minimum(tl.maximum(tl.floor(x / s + 0.5), -127.0), 127.0), s


@triton.jit
def _i8_to_f32(x):
    """int8 -> fp32 without the conversion unit (which Hopper runs at 16 values a clock per SM:
    the int8 cache's decode attention was bound by it): w8a16's packed conversion (MAGIC 2)."""
    return _to_compute(x, tl.float32, 2)


# The int8 cache's bytes as fp32 1 + (q + 128) / 2^15, four a call, by byte permutes alone
# (`prmt` puts each offset-binary byte under 1.0's exponent, in bits 8-15): the loop's products
# run on these and the constant leaves once a key or a partial (`_i8_values`), saving
# _S8_TO_F32's subtract. fp32 holds the 2^-15 steps exactly with 8 bits to spare; the cost is the
# rounding of a 128-term (a key's) or few-term (a partial's) sum near the constant.
_S8_TO_BIASED_F32 = tl.constexpr("""{
.reg .b32 u;
xor.b32 u, $4, 0x80808080;
prmt.b32 $0, u, 0x3F800000, 0x7604;
prmt.b32 $1, u, 0x3F800000, 0x7614;
prmt.b32 $2, u, 0x3F800000, 0x7624;
prmt.b32 $3, u, 0x3F800000, 0x7634;
}""")
# q = BIAS_STEP * b - BIAS_ZERO for b = 1 + (q + 128) / 2^15
BIAS_STEP, BIAS_ZERO = tl.constexpr(32768.0), tl.constexpr(32896.0)
# The int8 cache's route (biased since round 19: 0.68-0.91 x the exact loop's time on an H200
# at 32-64 rows; MPINFER_KV8_BIASED=0 the exact one) and keys a tile (64 won only past 2k keys)
BIASED = os.environ.get("MPINFER_KV8_BIASED", "1") == "1"
KV8_TILE_KEYS = int(os.environ.get("MPINFER_KV8_TILE_KEYS", "32"))


@triton.jit
def _i8_values(x, BIASED: tl.constexpr):
    """int8 -> fp32: x (_i8_to_f32), or BIASED 1 + (x + 128) / 2^15 (_S8_TO_BIASED_F32)."""
    if not BIASED:
        return _i8_to_f32(x)
    elif INTERPRETED:
        bits = ((x.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint32) << 8) | 0x3F800000
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.inline_asm_elementwise(_S8_TO_BIASED_F32, "=r,=r,=r,=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=4)  # fmt: skip


def _scale_strides(scales) -> tuple[int, int]:
    return (scales[0].stride(0), scales[0].stride(1)) if scales is not None else (0, 0)


# Keys per tile, warps and pipeline stages per program (the sweep's winner; stages did not matter)
TILE_KEYS, WARPS, STAGES = 32, 2, 3


@triton.jit
def _decode_attention_kernel(
    qkv_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, ws_ptr, slot_ptr, pos_ptr, vf_ptr, slope_ptr,
    table_ptr, stride_qkv, stride_cs, stride_ch, stride_cl, stride_ss, stride_sh, stride_t, scale,
    n_heads, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
    BIASED: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Program (b, h, s): split s of the keys [vf, pos) of row b, cut into n_splits equal runs
    of whole BLOCK_L tiles at run time (the row's length is known only on the device, so a
    captured graph serves every length), and (s == 0) the new token at pos. Writes its partial
    softmax state (max, sum, weighted values) to the workspace. BIASED (int8 cache): the
    products run on _i8_values' biased values, the constant off a key's score at once, and the
    values' sum across keys waits for the loop's end: ROWS rows of partials (the tile layout's
    rows, 4 a warp), each thread adding its own, the constant off each partial a tile."""
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
    table = table_ptr + slot.to(tl.int64) * stride_t
    head_off = h * stride_ch
    m = -float("inf")
    denom = 0.0
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    if s == 0:
        k_new = tl.load(base + HEAD_DIM + d)
        v_new = tl.load(base + 2 * HEAD_DIM + d)
        write = (d * 0 + slot_in) >= 0  # (HEAD_DIM,): every lane of a live row
        blk = tl.load(table + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        new_off = blk * stride_cs + head_off + (pos % BLOCK_SIZE) * stride_cl
        if QUANT:  # the new token as the cache will hold it: int8 and a scale per head
            k_q, k_s = _quantize(k_new.to(tl.float32))
            v_q, v_s = _quantize(v_new.to(tl.float32))
            tl.store(k_ptr + new_off + d, k_q.to(tl.int8), mask=write)
            tl.store(v_ptr + new_off + d, v_q.to(tl.int8), mask=write)
            s_off = blk * stride_ss + h * stride_sh + pos % BLOCK_SIZE
            tl.store(ks_ptr + s_off, k_s, mask=live)
            tl.store(vs_ptr + s_off, v_s, mask=live)
            k_val = k_q * k_s
            v_val = v_q * v_s
        else:
            tl.store(k_ptr + new_off + d, k_new, mask=write)
            tl.store(v_ptr + new_off + d, v_new, mask=write)
            k_val = k_new.to(tl.float32)
            v_val = v_new.to(tl.float32)
        m_new_token = tl.sum(q * k_val) * scale + slope * (pos - vf).to(tl.float32)
        m = tl.where(live, m_new_token, -float("inf"))
        denom = tl.where(live, 1.0, 0.0)
        acc = tl.where(live, v_val, 0.0)
    per_split = tl.cdiv(tl.cdiv(pos - vf, n_splits), BLOCK_L) * BLOCK_L
    lo = vf + s * per_split
    hi = tl.minimum(lo + per_split, pos)  # a padding row has pos = vf = 0: no tile at all
    offs = tl.arange(0, BLOCK_L)
    if QUANT and BIASED:  # the constant part of every key's score; the values' partials
        q_zero = BIAS_ZERO * tl.sum(q, axis=0)
        parts = tl.where(tl.arange(0, ROWS)[:, None] == 0, acc[None, :], 0.0)
    for start in tl.range(lo, hi, BLOCK_L):
        j = start + offs  # (BLOCK_L,) key positions
        ok = j < hi
        blk = tl.load(table + j // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)  # (BLOCK_L,)
        row_off = blk * stride_cs + head_off + (j % BLOCK_SIZE) * stride_cl
        kv_off = row_off[:, None] + d[None, :]
        if QUANT:  # int8 keys and values, a scale per key: applied to its score and weight
            keys = _i8_values(tl.load(k_ptr + kv_off, mask=ok[:, None], other=0), BIASED)
            vals = _i8_values(tl.load(v_ptr + kv_off, mask=ok[:, None], other=0), BIASED)
            s_off = blk * stride_ss + h * stride_sh + j % BLOCK_SIZE
            sc = tl.sum(keys * q[None, :], axis=1)
            if BIASED:
                sc = BIAS_STEP * sc - q_zero
            sc = sc * tl.load(ks_ptr + s_off, mask=ok, other=0.0)
        else:
            keys = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
            vals = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
            sc = tl.sum(keys * q[None, :], axis=1)
        sc = sc * scale + slope * (j - vf).to(tl.float32)
        sc = tl.where(ok, sc, -float("inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        if QUANT:
            pv = p * tl.load(vs_ptr + s_off, mask=ok, other=0.0)
        else:
            pv = p
        if QUANT and BIASED:  # no shuffles or barriers in the loop for the values' sum
            part = tl.sum(tl.reshape(pv[:, None] * vals, (BLOCK_L // ROWS, ROWS, HEAD_DIM)), 0)
            pvs = tl.sum(tl.reshape(pv, (BLOCK_L // ROWS, ROWS)), axis=0)
            parts = parts * alpha + (BIAS_STEP * part - BIAS_ZERO * pvs[:, None])
        else:
            acc = acc * alpha + tl.sum(pv[:, None] * vals, axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    if QUANT and BIASED:
        acc = tl.sum(parts, axis=0)
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
    tables: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    n_splits: int | None = None,
    block_l: int | None = None,
    num_warps: int = WARPS,
    num_stages: int = STAGES,
    biased: bool | None = None,
) -> torch.Tensor:
    """n_splits (programs per row and head) by default from the policy in
    tuning.attention_splits; the keyword arguments are for benchmarks and tests (`block_l`: keys
    a tile, default TILE_KEYS, an int8 cache's KV8_TILE_KEYS; `biased`: an int8 cache's route,
    default BIASED). `scales`: an int8 cache's (k_scale, v_scale), each (blocks, heads,
    block_size) fp32."""
    B = qkv.shape[0]
    heads, block_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    max_seq = tables.shape[1] * block_size
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    if n_splits is None:
        n_splits = attention_splits(B, heads, max_seq, sm_count(qkv.device.index))
    ws = torch.empty((B, heads, n_splits, head_dim + 2), dtype=torch.float32, device=qkv.device)
    if out is None:
        out = torch.empty((B, heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    ks, vs = scales if scales is not None else (k_cache, v_cache)  # (unread without QUANT)
    block_l = block_l or (TILE_KEYS if scales is None else KV8_TILE_KEYS)
    _decode_attention_kernel[(B, heads, n_splits)](
        qkv, k_cache, v_cache, ks, vs, ws, slot_ids, positions, valid_from, slopes, tables,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *_scale_strides(scales), tables.stride(0), head_dim**-0.5, heads, n_splits,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, QUANT=scales is not None, BLOCK_L=block_l,
        ROWS=min(4 * num_warps, block_l), BIASED=BIASED if biased is None else biased,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _combine_kernel[(B, heads)](
        ws, out, out.stride(0), heads, n_splits,
        HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(n_splits), num_warps=2,
    )  # fmt: skip
    return out


# The prompt-chunk kernel's query and key tiles: 64 x 64 at head_dim 128 keeps q, one key and one
# value tile and the fp32 accumulator in registers with 4 warps.
CHUNK_M, CHUNK_N, CHUNK_WARPS, CHUNK_STAGES = CHUNK_TILE, 64, 4, 2


@triton.jit
def _store_kv_kernel(qkv_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, seq_ptr, pos_ptr, table_ptr,
                     out_ptr, stride_qkv, stride_cs, stride_ch, stride_cl, stride_ss, stride_sh,
                     stride_t, stride_out, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     QUANT: tl.constexpr):  # fmt: skip
    """Program (t, h): token t's key and value of head h into its row's block (row -1: none;
    its attention output's head is zeros instead, which no attention kernel writes)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ptr + t)
    d = tl.arange(0, HEAD_DIM)
    if seq < 0:
        o = out_ptr + t.to(tl.int64) * stride_out + h * HEAD_DIM + d
        tl.store(o, tl.zeros((HEAD_DIM,), dtype=out_ptr.dtype.element_ty))
        return
    pos = tl.load(pos_ptr + t)
    blk = tl.load(table_ptr + seq.to(tl.int64) * stride_t + pos // BLOCK_SIZE).to(tl.int64)
    src = qkv_ptr + t.to(tl.int64) * stride_qkv + h * 3 * HEAD_DIM
    dst = blk * stride_cs + h * stride_ch + (pos % BLOCK_SIZE) * stride_cl + d
    k = tl.load(src + HEAD_DIM + d)
    v = tl.load(src + 2 * HEAD_DIM + d)
    if QUANT:
        k_q, k_s = _quantize(k.to(tl.float32))
        v_q, v_s = _quantize(v.to(tl.float32))
        tl.store(k_ptr + dst, k_q.to(tl.int8))
        tl.store(v_ptr + dst, v_q.to(tl.int8))
        s_off = blk * stride_ss + h * stride_sh + pos % BLOCK_SIZE
        tl.store(ks_ptr + s_off, k_s)
        tl.store(vs_ptr + s_off, v_s)
    else:
        tl.store(k_ptr + dst, k)
        tl.store(v_ptr + dst, v)


@triton.jit
def _chunk_attention_kernel(
    qkv_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tile_ptr, slope_ptr, table_ptr, stride_tile,
    stride_qkv, stride_out, stride_cs, stride_ch, stride_cl, stride_ss, stride_sh, stride_t,
    scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Program (i, h): tile i = (cache row, first token, count, first position) of the tile
    table (4, n_tiles), rows stride_tile apart; queries attend causally to keys [0, their
    position]."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(tile_ptr + 2 * stride_tile + i)
    if n == 0:
        return
    seq = tl.load(tile_ptr + i)
    tok0 = tl.load(tile_ptr + stride_tile + i)
    pos0 = tl.load(tile_ptr + 3 * stride_tile + i)
    slope = tl.load(slope_ptr + h)
    m_idx = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q_ok = m_idx < n
    q_rows = (tok0 + m_idx).to(tl.int64)
    q = tl.load(qkv_ptr + q_rows[:, None] * stride_qkv + h * 3 * HEAD_DIM + d[None, :],
                mask=q_ok[:, None], other=0.0)  # fmt: skip
    q_pos = pos0 + m_idx  # (BLOCK_M,)
    table = table_ptr + seq.to(tl.int64) * stride_t
    m = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    hi = pos0 + n  # keys [0, hi): the tile's last query sees them all
    for start in tl.range(0, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        k_ok = j < hi
        blk = tl.load(table + j // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        row_off = blk * stride_cs + h * stride_ch + (j % BLOCK_SIZE) * stride_cl
        kv_off = row_off[:, None] + d[None, :]
        if QUANT:  # int8 and a scale per key: dequantized to the queries' dtype
            keys = tl.load(k_ptr + kv_off, mask=k_ok[:, None], other=0)  # (BLOCK_N, HEAD_DIM)
            s_off = blk * stride_ss + h * stride_sh + j % BLOCK_SIZE
            k_s = tl.load(ks_ptr + s_off, mask=k_ok, other=0.0)
            keys = (_i8_to_f32(keys) * k_s[:, None]).to(q.dtype)
        else:
            keys = tl.load(k_ptr + kv_off, mask=k_ok[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(keys))
        sc = sc * scale + slope * j[None, :].to(tl.float32)  # (BLOCK_M, BLOCK_N)
        sc = tl.where((j[None, :] <= q_pos[:, None]) & k_ok[None, :], sc, -float("inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        if QUANT:
            vals = tl.load(v_ptr + kv_off, mask=k_ok[:, None], other=0)
            v_s = tl.load(vs_ptr + s_off, mask=k_ok, other=0.0)
            vals = (_i8_to_f32(vals) * v_s[:, None]).to(q.dtype)
        else:
            vals = tl.load(v_ptr + kv_off, mask=k_ok[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(vals.dtype), vals, input_precision="ieee")
        else:
            pv = tl.dot(p.to(vals.dtype), vals)
        acc = acc * alpha[:, None] + pv
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_out + h * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None])  # fmt: skip


def store_kv(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: torch.Tensor,
             positions: torch.Tensor, tables: torch.Tensor, scales, out: torch.Tensor
             ) -> None:  # fmt: skip
    """Every token's key and value (qkv row t: cache row seq[t], position positions[t]);
    with `scales` (an int8 cache's), quantized with a scale per token and head; zeros in the
    rows of `out` (the step's attention output, N x heads * head_dim) of tokens of row -1."""
    heads, block_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    ks, vs = scales if scales is not None else (k_cache, v_cache)
    _store_kv_kernel[(qkv.shape[0], heads)](
        qkv, k_cache, v_cache, ks, vs, seq, positions, tables, out,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *_scale_strides(scales), tables.stride(0), out.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, QUANT=scales is not None, num_warps=1,
    )  # fmt: skip


def chunk_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tiles: torch.Tensor, slopes: torch.Tensor, tables: torch.Tensor,
                    out: torch.Tensor, scales=None) -> None:  # fmt: skip
    """The prompt-chunk tiles' attention into their rows of `out` (N, heads * head_dim);
    `tiles` (4, n_tiles) int64: cache row, first token, count, first position of each tile."""
    heads, block_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n_tiles = tiles.shape[1]
    if n_tiles == 0:
        return
    assert tiles.stride(1) == 1 and k_cache.stride() == v_cache.stride()
    ks, vs = scales if scales is not None else (k_cache, v_cache)
    _chunk_attention_kernel[(n_tiles, heads)](
        qkv, k_cache, v_cache, ks, vs, out, tiles, slopes, tables, tiles.stride(0),
        qkv.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *_scale_strides(scales), tables.stride(0), head_dim**-0.5,
        HEAD_DIM=head_dim, BLOCK_M=CHUNK_M, BLOCK_N=CHUNK_N, BLOCK_SIZE=block_size,
        IEEE=qkv.dtype == torch.float32, QUANT=scales is not None, num_warps=CHUNK_WARPS,
        num_stages=CHUNK_STAGES,
    )  # fmt: skip
