"""The W4A16 matmul, in Triton, for every row count a step has: group-wise int4 weights,
converted in registers, the same loops, grid, split-K and fused epilogue as the int8 kernel
(w8a16.py, launch.py).

    y = act(x @ w^T + bias) + residual,    w[n, k] = q[n, k] * scale[g, n] + offset[g, n]

    x (M, K) fp16/bf16    packed (N, K/2) uint8    scale, offset (K/G, N) fp16    g = k // G

Scales and offsets are stored group-major, so the BLOCK_N of them a tile needs are contiguous
(one or two memory sectors, not one per row).

Packing (quant.py's `quantize_int4`): group g's G weights of row n are the G/2 bytes
[g G/2, (g+1) G/2) of that row; byte b holds k = g G + b in its low nibble and k = g G + G/2 + b
in its high one. So a program's K tile is one group (BLOCK_K = G): one scale and offset per row
of the tile, and each nibble half pairs with a contiguous half of x's columns, so a tile is two
dots of G/2 with plain, coalesced loads of x (no interleave, no shuffle in registers).

Loops, as in w8a16.py: `dot` (x @ w^T), `swap` (w @ x^T, the converted tile as the left
operand) and `fma` (one row, products in an fp32 tile, reduced once after the loop). MAGIC 1
(fp16 only) converts a nibble by the bit trick (0x6400 | q is the fp16 number 1024 + q) and
applies scale and offset in fp16, one weight at a time; MAGIC 2 does the same in packed PTX,
eight weights from four bytes in 17 instructions with no conversion-unit work (the tensor-core
loops: fp16 only; the one-row loop: any dtype, its fp16 weights then widened to fp32); MAGIC 0
goes through fp32 (the int -> float conversion unit, 16 values per clock per SM on Hopper: two
per byte is about what caps a one-row int4 launch near 1.2 TB/s). MAGIC 2 in the one-row loop
still widens each fp16 weight to fp32 in that unit, which held it near 1.4 TB/s; MAGIC 3 and 4
(one-row loop only) never convert a weight: each nibble goes under the mantissa of an fp32 1.0
(low nibble at mantissa bit 16, 1 + q/128; high at bit 12, 1 + q/2048), and the group's scale
and offset are refolded per row, once a group, so one fp32 multiply-add gives the weight:

    q s + z = m (128 s) + (z - 128 s)   (low)        m (2048 s) + (z - 2048 s)   (high)

(exact but for one rounding of the offset and one of the product: errors under 2^-11 s, far
below fp16's rounding of the weight in MAGIC 2). MAGIC 3 does it in Triton ops, MAGIC 4 in
packed PTX (one `prmt` and two `lop3` a byte). MAGIC 5 (`_factored`) makes MAGIC 4's mantissas
but leaves the scale and offset out of the products: it sums a thread's run of eight m * x and
applies the group's scale and offset to the sum, one fma a weight instead of two, which is what
the one-row loop is short of (its instructions, not its loads, set its pace: about 3 a weight
against int8's 1.3). PREFETCH 1 makes the one-row loop take two groups
an iteration (two independent weight loads in flight; Triton does not pipeline that loop).
MAGIC 7 (the swap loop, fp16, from one row up) hands the tensor cores q alone, made from a
fragment's byte pair as loaded in 1.5 instructions a weight, and applies each group's scale and
offset to their sums: the tensor cores do the products a one-row loop spends instructions on.
On an H200 it won most 16-row launches; at one row magic5 stays faster (its loop keeps more
warps on an SM: docs/performance.md, round 11). MAGIC 8 (the one-row loop, fp16 only) does the
products in packed fp16 instead: a row's bytes four at a time, q - 8 made exact in two fp16
lanes and multiplied by a pair of x in one `fma.f16x2`, summed in fp16 over eight products a
lane, the group's scale and offset applied to each run's sums (2.8-3.2 instructions a weight
compiled for sm_90a, magic5 4.4). MAGIC 9 is MAGIC 8 with each group's sum of x from the launcher
(magic7's small reduction) instead of from the loop: fewer instructions a weight, one more
launch. Both load a row's two groups of a tile as one run (LINES): a load instruction then
takes whole 128-byte lines of 4 rows, not one 64-byte group of 8 rows. The loop's loads set
its pace (its arithmetic alone runs in a third of its time: docs/performance.md, round 21),
and whole lines gave 2-5 % on an H100. The conversions themselves (the PTX and its interpreter
twins) are w4a16_convert.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import device_scratch, launch_plan, reduce_and_finish
from .w4a16_convert import (
    FACTOR_RUN,
    WORD_RUN,
    _factored,
    _nibbles,
    _pair,
    _pairs,
    _word_group,
    _word_group_xs,
)

# The packed one-row loop (MAGIC 8, 9) loads whole 128-byte lines of 4 rows (MPINFER_INT4_LINES=0,
# a diagnostic switch, gives round 20's half lines of 8 rows; `lines=` per call).
LINES = os.environ.get("MPINFER_INT4_LINES", "1") == "1"


@triton.jit(do_not_specialize=["split_k"])
def _w4a16(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, xs_ptr,
    M, N, K, stride_xm, stride_ym, stride_rm, split_k,
    BLOCK_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DOT: tl.constexpr, SWAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, MAGIC: tl.constexpr, STAGES: tl.constexpr,
    LINES: tl.constexpr = 0, ABLATE: tl.constexpr = 0,
):  # fmt: skip
    # BLOCK_K is the group size; split_k cuts the groups into runs; PREFETCH: the one-row loop
    # takes two groups an iteration.
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m = tl.program_id(0)  # row tiles fastest: they share each weight tile in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    groups = K // BLOCK_K
    g_per_split = tl.cdiv(groups, split_k)
    g_lo = pid_k * g_per_split
    g_hi = tl.minimum(groups, g_lo + g_per_split)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    n_ok = offs_n < N
    rows = tl.arange(0, BLOCK_N)
    first = (pid_n * BLOCK_N).to(tl.int64)  # 64-bit: N x K / 2 passes 2^31 for the big heads
    if MAGIC == 7:
        # a row's bytes start 16-byte aligned (K is a multiple of 32: `w4a16_matmul`), so the
        # tile's copies go in 16-byte pieces (the one-row loops compile to more instructions so)
        row_bytes = tl.multiple_of(K // 2, 16)
    else:
        row_bytes = K // 2
    w_ptrs = (w_ptr + first * row_bytes + rows[:, None] * row_bytes + g_lo * HALF
              + offs_h[None, :])  # (BLOCK_N, HALF)  # fmt: skip
    s_ptrs = s_ptr + g_lo * N + offs_n  # (BLOCK_N,): contiguous, the groups are rows
    z_ptrs = z_ptr + g_lo * N + offs_n
    cdt = x_ptr.dtype.element_ty
    tile = pid_m * tl.num_programs(1) + pid_n
    if USE_DOT and SWAP:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m[None, :] < M
        xt_ptrs = x_ptr + offs_m[None, :] * stride_xm + (g_lo * BLOCK_K + offs_h)[:, None]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if MAGIC == 7:
            # s * sum(q x) + z * sum(x) a group (the pairs' comment); each group's scales and
            # offsets are loaded one group ahead (Triton pipelines only the dots' loads)
            xs_ptrs = xs_ptr + offs_m * groups + g_lo  # (BLOCK_M,): row m's group sums
            row_ok = offs_m < M
            s_next = tl.load(s_ptrs, mask=n_ok, other=0.0).to(tl.float32)
            z_next = tl.load(z_ptrs, mask=n_ok, other=0.0).to(tl.float32)
            xs_next = tl.load(xs_ptrs, mask=row_ok, other=0.0)
            for g in range(g_lo, g_hi):
                b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
                x_lo = tl.load(xt_ptrs, mask=m_ok, other=0.0)  # (HALF, BLOCK_M)
                x_hi = tl.load(xt_ptrs + HALF, mask=m_ok, other=0.0)
                s = s_next
                z = z_next
                xs = xs_next
                more = tl.minimum(g_hi - g - 1, 1)  # 0 for the split's last group: none past it
                s_next = tl.load(s_ptrs + N, mask=offs_n < N * more, other=0.0).to(tl.float32)
                z_next = tl.load(z_ptrs + N, mask=offs_n < N * more, other=0.0).to(tl.float32)
                xs_next = tl.load(xs_ptrs + 1, mask=offs_m < M * more, other=0.0)
                lo, hi = _pairs(b)
                qx = tl.dot(lo, x_lo)
                qx = tl.dot(hi, x_hi, qx)
                acc_t += qx * s[:, None]  # two fused multiply-adds an output
                acc_t += z[:, None] * xs[None, :]
                w_ptrs += HALF
                s_ptrs += N
                z_ptrs += N
                xs_ptrs += 1
                xt_ptrs += BLOCK_K
        else:
            for _ in range(g_lo, g_hi):
                b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
                s = tl.load(s_ptrs, mask=n_ok, other=0.0)[:, None]
                z = tl.load(z_ptrs, mask=n_ok, other=0.0)[:, None]
                lo, hi = _nibbles(b, s, z, cdt, MAGIC)  # (BLOCK_N, HALF) each
                x_lo = tl.load(xt_ptrs, mask=m_ok, other=0.0)  # (HALF, BLOCK_M)
                x_hi = tl.load(xt_ptrs + HALF, mask=m_ok, other=0.0)
                acc_t = tl.dot(lo, x_lo, acc_t)
                acc_t = tl.dot(hi, x_hi, acc_t)  # (BLOCK_N, BLOCK_M)
                w_ptrs += HALF
                s_ptrs += N
                z_ptrs += N
                xt_ptrs += BLOCK_K
        mask = n_ok[:, None] & m_ok
        n_idx = offs_n[:, None] + 0 * offs_m[None, :]
        reduce_and_finish(
            acc_t, mask, n_idx, offs_m[None, :] * stride_ym + offs_n[:, None],
            offs_m[None, :] * stride_rm + offs_n[:, None], offs_m[None, :] * N + offs_n[:, None],
            tile, pid_k, split_k, M * N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            False, HAS_BIAS, ACT, HAS_RES,
        )  # fmt: skip
    elif USE_DOT:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m[:, None] < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (g_lo * BLOCK_K + offs_h)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(g_lo, g_hi):
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            s = tl.load(s_ptrs, mask=n_ok, other=0.0)[:, None]
            z = tl.load(z_ptrs, mask=n_ok, other=0.0)[:, None]
            lo, hi = _nibbles(b, s, z, cdt, MAGIC)
            x_lo = tl.load(x_ptrs, mask=m_ok, other=0.0)  # (BLOCK_M, HALF)
            x_hi = tl.load(x_ptrs + HALF, mask=m_ok, other=0.0)
            acc = tl.dot(x_lo, tl.trans(lo), acc)
            acc = tl.dot(x_hi, tl.trans(hi), acc)  # (BLOCK_M, BLOCK_N)
            w_ptrs += HALF
            s_ptrs += N
            z_ptrs += N
            x_ptrs += BLOCK_K
        mask = m_ok & n_ok[None, :]
        n_idx = offs_n[None, :] + 0 * offs_m[:, None]
        reduce_and_finish(
            acc, mask, n_idx, offs_m[:, None] * stride_ym + offs_n[None, :],
            offs_m[:, None] * stride_rm + offs_n[None, :], offs_m[:, None] * N + offs_n[None, :],
            tile, pid_k, split_k, M * N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            False, HAS_BIAS, ACT, HAS_RES,
        )  # fmt: skip
    else:  # one row
        if MAGIC >= 8:  # in packed fp16, words of four bytes (w4a16_convert.py)
            # GP groups an iteration (PREFETCH 1: two) as one (BLOCK_N, GP, WORDS) tile: a row's
            # GP groups are adjacent, so their words are one run of loads issued together. No masks
            # in the loop: rows past N read row N - 1 (their sums are not stored), and a split's
            # missing last group of GP reads its first again with its scale and offset zeroed.
            WORDS: tl.constexpr = HALF // 4
            GP: tl.constexpr = 1 + PREFETCH
            offs_w = tl.arange(0, WORDS)[None, None, :]
            grp = tl.arange(0, GP)
            words = tl.multiple_of(K // 8, 4)  # a row's 32-bit words (K % 32 == 0)
            rows_c = tl.minimum(offs_n, N - 1).to(tl.int64)
            w32 = (w_ptr.to(tl.pointer_type(tl.int32)) + rows_c[:, None, None] * words
                   + g_lo * WORDS + offs_w)  # fmt: skip
            x64 = x_ptr.to(tl.pointer_type(tl.int64)) + g_lo * (BLOCK_K // 4) + offs_w
            sz = g_lo * N + rows_c[:, None]  # (BLOCK_N, 1): scales' and offsets' offsets
            # LINES: a row's GP groups as one (BLOCK_N, GP * WORDS) load, so each load covers
            # whole 128-byte lines of fewer rows (else a load takes one group of more rows: half
            # lines), the groups past the split masked off
            offs_c = tl.arange(0, GP * WORDS)[None, :]
            wrow = (w_ptr.to(tl.pointer_type(tl.int32)) + rows_c[:, None] * words + g_lo * WORDS
                    + offs_c)  # fmt: skip
            acc3 = tl.zeros((BLOCK_N, GP, WORDS // WORD_RUN), dtype=tl.float32)
            # STAGES 2 or more: a register pipeline, the next tile's weights, scales and offsets
            # loaded before this tile's arithmetic (Triton's pipeliner leaves a loop without
            # dots alone, and ptxas issues loads after the arithmetic before them). x is not
            # carried (its pairs would be 64 registers more, for loads that hit L1). Past the
            # split's end the next tile re-reads the split's last group, unused (LINES: masked
            # off, nothing read).
            if STAGES >= 2:
                gi = tl.minimum(grp, g_hi - g_lo - 1)
                b_n, s_n, z_n = _word_weights(w32, wrow, offs_c, g_hi - g_lo, s_ptr, z_ptr, sz, gi,
                                              N, BLOCK_N, GP, WORDS, LINES, ABLATE)  # fmt: skip
            for g in range(g_lo, g_hi, GP):
                last = tl.minimum(g_hi - g, GP) - 1  # the tile's last real group
                gi = tl.minimum(grp, last)
                if STAGES >= 2:
                    b, s, z = b_n, s_n, z_n
                    gn = tl.minimum(grp, g_hi - g - GP - 1)  # the next tile's
                    b_n, s_n, z_n = _word_weights(w32 + GP * WORDS, wrow + GP * WORDS, offs_c,
                                                  g_hi - g - GP, s_ptr, z_ptr, sz + GP * N, gn, N,
                                                  BLOCK_N, GP, WORDS, LINES, ABLATE)  # fmt: skip
                else:
                    b, s, z = _word_weights(w32, wrow, offs_c, g_hi - g, s_ptr, z_ptr, sz, gi, N,
                                            BLOCK_N, GP, WORDS, LINES, ABLATE)  # fmt: skip
                xl, xh, xg = _word_xs(x64, xs_ptr, g, gi, WORDS, MAGIC)
                if ABLATE & 4:  # no weight loads: words that change with the tile
                    b = b + g
                keep = (grp <= last)[None, :]  # a repeated group's scale and offset are zeroed
                s = tl.where(keep, s, 0.0)
                z = tl.where(keep, z, 0.0)
                if ABLATE & 8:  # each load used once, no products
                    acc3 += _word_light(b, s, z, xl, xh, xg)[:, :, None]
                else:
                    acc3 += _word_sums(b, s, z, xl, xh, xg, BLOCK_N, GP, WORDS, MAGIC)
                wrow += GP * WORDS
                w32 += GP * WORDS
                x64 += GP * 2 * WORDS
                sz += GP * N
            acc2 = tl.sum(acc3, axis=2)
        else:  # MAGIC 1 (fp16 only) is MAGIC 0 here: its weights would be widened
            CONV: tl.constexpr = 0 if MAGIC == 1 else MAGIC
            ACC_K: tl.constexpr = HALF // FACTOR_RUN if MAGIC == 5 else HALF
            acc2 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
            x_ptrs = x_ptr + g_lo * BLOCK_K + offs_h
            for g in range(g_lo, g_hi, 1 + PREFETCH):
                b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
                s = tl.load(s_ptrs, mask=n_ok, other=0.0)[:, None]
                z = tl.load(z_ptrs, mask=n_ok, other=0.0)[:, None]
                if PREFETCH:  # the next group too (zeros past the split: s = z = 0)
                    has2 = tl.minimum(g_hi - g - 1, 1)  # 1 if the split has a next group, else 0
                    ok2 = offs_n < N * has2
                    b2 = tl.load(w_ptrs + HALF, mask=ok2[:, None], other=0)
                    s2 = tl.load(s_ptrs + N, mask=ok2, other=0.0)[:, None]
                    z2 = tl.load(z_ptrs + N, mask=ok2, other=0.0)[:, None]
                    h_ok = offs_h < HALF * has2
                    x2_lo = tl.load(x_ptrs + BLOCK_K, mask=h_ok, other=0.0).to(tl.float32)
                    x2_hi = tl.load(x_ptrs + BLOCK_K + HALF, mask=h_ok, other=0.0).to(tl.float32)
                x_lo = tl.load(x_ptrs).to(tl.float32)
                x_hi = tl.load(x_ptrs + HALF).to(tl.float32)
                if MAGIC == 5:
                    acc2 += _factored(b, s, z, x_lo, x_hi, BLOCK_N, HALF)
                    if PREFETCH:
                        acc2 += _factored(b2, s2, z2, x2_lo, x2_hi, BLOCK_N, HALF)
                else:
                    lo, hi = _nibbles(b, s, z, tl.float32, CONV)
                    acc2 += lo * x_lo[None, :] + hi * x_hi[None, :]
                    if PREFETCH:
                        lo2, hi2 = _nibbles(b2, s2, z2, tl.float32, CONV)
                        acc2 += lo2 * x2_lo[None, :] + hi2 * x2_hi[None, :]
                w_ptrs += HALF * (1 + PREFETCH)
                s_ptrs += N * (1 + PREFETCH)
                z_ptrs += N * (1 + PREFETCH)
                x_ptrs += BLOCK_K * (1 + PREFETCH)
        acc = tl.sum(acc2, axis=1)  # (BLOCK_N,)
        reduce_and_finish(
            acc, n_ok, offs_n, offs_n, offs_n, offs_n,
            tile, pid_k, split_k, N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            False, HAS_BIAS, ACT, HAS_RES,
        )  # fmt: skip


@triton.jit
def _word_weights(w32, wrow, offs_c, groups, s_ptr, z_ptr, sz, gi, N, BLOCK_N: tl.constexpr,
                  GP: tl.constexpr, WORDS: tl.constexpr, LINES: tl.constexpr,
                  ABLATE: tl.constexpr):  # fmt: skip
    """The packed loop's weight loads of a tile, its groups gi from the tile's first (w32, sz:
    that group's pointers and scale offsets): words (BLOCK_N, GP, WORDS), scales and offsets
    (BLOCK_N, GP). LINES: the words as one (BLOCK_N, GP * WORDS) run a row from wrow, the
    groups past the tile's first `groups` masked off (their scales and offsets are zeroed
    after). ABLATE (diagnostics, access_pattern --ablate): & 1 no scale or offset loads, & 4
    no weight loads."""
    if ABLATE & 4:
        b = tl.zeros((BLOCK_N, GP, WORDS), dtype=tl.int32) + 0x12345678
    elif LINES:
        n_ok = tl.multiple_of(tl.minimum(tl.maximum(groups, 0), GP) * WORDS, WORDS)
        b = tl.reshape(tl.load(wrow, mask=offs_c < n_ok, other=0), (BLOCK_N, GP, WORDS))
    else:
        b = tl.load(w32 + gi[None, :, None] * WORDS)
    if ABLATE & 1:
        s = tl.zeros((BLOCK_N, GP), dtype=tl.float16) + 0.01 + gi[None, :].to(tl.float16)
        z = s
    else:
        s = tl.load(s_ptr + sz + gi[None, :] * N)
        z = tl.load(z_ptr + sz + gi[None, :] * N)
    return b, s, z


@triton.jit
def _word_light(b, s, z, xl, xh, xg):
    """ABLATE & 8: each load used once, no products: (BLOCK_N, GP)."""
    v = tl.sum((b ^ _pair(xl, 0) ^ _pair(xh, 1)).to(tl.float32), axis=2)
    return v * s.to(tl.float32) + z.to(tl.float32) + xg[None, :]


@triton.jit
def _word_xs(x64, xs_ptr, g, gi, WORDS: tl.constexpr, MAGIC: tl.constexpr):
    """x's two halves of a tile's groups as 32-bit pairs (x64: the tile's first group's) and,
    for MAGIC 9, the groups' sums of x (else a stand-in, unused)."""
    xl = tl.load(x64 + gi[None, :, None] * (2 * WORDS))
    xh = tl.load(x64 + gi[None, :, None] * (2 * WORDS) + WORDS)
    if MAGIC == 9:
        xg = tl.load(xs_ptr + g + gi)
    else:
        xg = gi.to(tl.float32)
    return xl, xh, xg


@triton.jit
def _word_sums(b, s, z, xl, xh, xg, BLOCK_N: tl.constexpr, GP: tl.constexpr,
               WORDS: tl.constexpr, MAGIC: tl.constexpr):  # fmt: skip
    """A tile's (BLOCK_N, GP, runs) sums: MAGIC 9 with the launcher's sums of x, 8 without."""
    if MAGIC == 9:
        return _word_group_xs(b, s, z, xl, xh, xg, BLOCK_N, GP, WORDS)
    else:
        return _word_group(b, s, z, xl, xh, BLOCK_N, GP, WORDS)


def w4a16_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    config: str | None = None,
    lines: bool | None = None,
    ablate: int = 0,
) -> torch.Tensor:
    """The fused W4A16 matmul with `config` (a tuning.py config name), else the tuned table's
    config for this GPU and shape, else the default rule's. The group size is K / scale's
    rows. `lines` (None: LINES) and `ablate` (0: none) are the one-row packed loop's
    diagnostics (tools/diag/access_pattern.py)."""
    M, K = x.shape
    N = packed.shape[0]
    group = K // scale.shape[0]
    assert packed.shape[1] * 2 == K and packed.dtype == torch.uint8 and packed.is_contiguous()
    assert K % 32 == 0, f"int4: {K} inputs are not a multiple of 32 (rows of 16-byte pieces)"
    assert scale.shape == offset.shape == (K // group, N) and K % group == 0
    x = x.contiguous()
    if residual is not None:
        residual = residual.reshape(M, N)
        assert residual.stride(1) == 1
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    kw, warps, stages, grid = launch_plan(x, N, K, config, bits=4, group=group)
    kw.pop("TMA")  # int8's alone (tuning.illegal)
    ws, counters = device_scratch(x.device)
    # magic7's sums of each row of x over each group (M, K / group), fp32
    xs = (torch.sum(x.view(M, K // group, group), dim=2, dtype=torch.float32)
          if kw["MAGIC"] in (7, 9) else ws)  # fmt: skip
    _w4a16[grid](
        x, packed, scale.contiguous(), offset.contiguous(),
        bias if bias is not None else y, residual if residual is not None else y, y, ws, counters,
        xs,
        M, N, K, x.stride(0), y.stride(0), residual.stride(0) if residual is not None else 0,
        kw["split_k"], HAS_BIAS=bias is not None, ACT=gelu, HAS_RES=residual is not None,
        **{k: v for k, v in kw.items() if k != "split_k"}, STAGES=stages, num_warps=warps,
        num_stages=stages, LINES=LINES if lines is None else lines, ABLATE=ablate,
    )  # fmt: skip
    return y
