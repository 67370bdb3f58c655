"""The W4A16 matmul's warp-specialized loop for many rows (Hopper): int4's `tma` configs.

int8's `tma` loop (w8a16_tma.py) for group-wise int4 weights: y^T = w @ x^T with each group's
converted tile as the tensor cores' register operand, its copies made by the TMA engine and its
K loop split by Triton's Hopper warp specialization into a producer warp group (the copies of
the packed weight tile, of the group's scales and offsets and of x's two half tiles) and a
consumer warp group (conversion and products). A K tile is one group (BLOCK_K = G), as in
w4a16.py: its low nibbles pair with x's first G/2 columns and its high ones with the next G/2,
so a group is two products into one accumulator, with the scale and offset applied to the
converted weights (MAGIC 1, fp16; MAGIC 0, through fp32, any dtype).

Triton 3.6 and 3.9 partition the weight tile between two consumers only for a single product an
iteration: with int4's two, the partitioner fails (`warp_group_dot` type mismatch). So the
weight tile is 64 rows (one consumer's wgmma height) and x's tile at most 128 rows, which Triton
warp-specializes without partitioning (`tuning.illegal` says so). The copies need rows of 16
bytes: K % 32 == 0 (`w4a16_matmul` asserts it) and x aligned as w8a16_tma.py says.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .w4a16_convert import _nibbles
from .w8a16_tma import launch_tma, split_bounds, tma_epilogue


@triton.jit(do_not_specialize=["split_k"])
def _w4a16_tma(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, r_ptr, y_ptr, ws_ptr,
    M, N, K, stride_xm, stride_ym, stride_rm, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, MAGIC: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m = tl.program_id(0)  # row tiles fastest: they share each weight tile in L2
    pid_n = tl.program_id(1)
    k_lo, k_hi = split_bounds(K, BLOCK_K, split_k)  # whole groups
    cdt = x_ptr.dtype.element_ty
    groups = K // BLOCK_K
    # made in the kernel, as int8's are (w8a16_tma.py says why)
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, HALF])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K // 2], [K // 2, 1], [BLOCK_N, HALF])
    # scales and offsets are group-major (K / G, N): a group's BLOCK_N of them are one row
    s_desc = tl.make_tensor_descriptor(s_ptr, [groups, N], [N, 1], [1, BLOCK_N])
    z_desc = tl.make_tensor_descriptor(z_ptr, [groups, N], [N, 1], [1, BLOCK_N])
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in tl.range(k_lo // BLOCK_K, k_hi // BLOCK_K, num_stages=STAGES, warp_specialize=True):
        b = w_desc.load([pid_n * BLOCK_N, g * HALF])  # (BLOCK_N, HALF) packed bytes
        s = tl.reshape(s_desc.load([g, pid_n * BLOCK_N]), (BLOCK_N, 1))
        z = tl.reshape(z_desc.load([g, pid_n * BLOCK_N]), (BLOCK_N, 1))
        x_lo = x_desc.load([pid_m * BLOCK_M, g * BLOCK_K])  # (BLOCK_M, HALF)
        x_hi = x_desc.load([pid_m * BLOCK_M, g * BLOCK_K + HALF])
        lo, hi = _nibbles(b, s, z, cdt, MAGIC)  # (BLOCK_N, HALF) each
        acc_t = tl.dot(lo, tl.trans(x_lo), acc_t)
        acc_t = tl.dot(hi, tl.trans(x_hi), acc_t)  # (BLOCK_N, BLOCK_M)
    # the scales and offsets were applied in the loop: no scale in the epilogue
    tma_epilogue(acc_t, M, N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, stride_ym, stride_rm, BLOCK_M,
                 BLOCK_N, False, HAS_BIAS, ACT, HAS_RES, SPLIT)  # fmt: skip


def w4a16_tma_matmul(x, packed, scale, offset, bias, gelu, residual, y, kw, stages, grid):
    """Launch an int4 `tma` config (w4a16_matmul's arguments, its launch plan; 4 warps)."""
    assert packed.data_ptr() % 16 == 0 and x.shape[1] % 32 == 0, "tma: packed rows not aligned"
    assert scale.data_ptr() % 16 == 0 and offset.data_ptr() % 16 == 0 and y.shape[1] % 8 == 0, \
        "tma: the scales' rows are not 16-byte aligned"  # fmt: skip
    # int4's scales and offsets were applied in the loop: none in a split's second launch
    return launch_tma(_w4a16_tma, x, (packed, scale, offset), scale, bias, gelu, residual, y, kw,
                      stages, grid, has_scale=False)  # fmt: skip
