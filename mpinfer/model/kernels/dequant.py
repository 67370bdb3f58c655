"""A quantized weight in the compute dtype, in one pass, for the launches of more than
DEQUANT_ROWS rows (kernels/__init__.py says why): int8 rows, w = q * scale[:, None], and int4
groups, w = q * scale + offset (quant.py's packing).

torch's broadcasting `q * scale[:, None]` moved about 1 TB/s on the H200 (19 ms of a 72 ms
2048-token bloom-7b1 prefill); these kernels read 1 (int8) or 1/2 (int4) byte and write 2 per
weight in 2D tiles. The copy lives for one matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, w_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    idx = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    q = tl.load(q_ptr + idx, mask=ok, other=0).to(tl.float32)
    s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    tl.store(w_ptr + idx, (q * s[:, None]).to(w_ptr.dtype.element_ty), mask=ok)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, K = q.shape
    w = torch.empty((N, K), dtype=dtype, device=q.device)
    grid = (triton.cdiv(N, 16), triton.cdiv(K, 512))
    _dequant_kernel[grid](q, scale, w, N, K, BLOCK_N=16, BLOCK_K=512, num_warps=4)
    return w


@triton.jit
def _dequant_int4_kernel(p_ptr, s_ptr, z_ptr, w_ptr, N, K, HALF: tl.constexpr,
                         BLOCK_N: tl.constexpr):  # fmt: skip
    """One (BLOCK_N rows, one group) tile: w[n, g G + h] = lo * s + z, w[n, g G + HALF + h] =
    hi * s + z (quant.py's packing; s, z group-major)."""
    g = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    ok = offs_n[:, None] < N
    rows = offs_n[:, None].to(tl.int64)
    b = tl.load(p_ptr + rows * (K // 2) + g * HALF + offs_h[None, :], mask=ok, other=0)
    s = tl.load(s_ptr + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    z = tl.load(z_ptr + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    lo = ((b & 0xF).to(tl.float32) * s + z).to(w_ptr.dtype.element_ty)
    hi = ((b >> 4).to(tl.float32) * s + z).to(w_ptr.dtype.element_ty)
    base = w_ptr + rows * K + g * (2 * HALF) + offs_h[None, :]
    tl.store(base, lo, mask=ok)
    tl.store(base + HALF, hi, mask=ok)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    groups, N = scale.shape
    K = packed.shape[1] * 2
    w = torch.empty((N, K), dtype=dtype, device=packed.device)
    grid = (triton.cdiv(N, 16), groups)
    _dequant_int4_kernel[grid](packed, scale, offset, w, N, K, HALF=K // groups // 2, BLOCK_N=16,
                               num_warps=4)  # fmt: skip
    return w
