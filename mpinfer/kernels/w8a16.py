"""W8A16 matmul for few rows (decode): y = (x @ q^T) * scale + bias, in Triton.

Two kernels: `_w8a16_kernel` (tensor cores, rows padded to 16) for fp16 activations and for
2..64 bf16 rows; `_gemv_kernel` for one bf16 row.

    x (M, K) fp16/bf16    q (N, K) int8, row-major    scale (N,) fp32    y (M, N) x.dtype

Program (pid_n, pid_m) owns a BLOCK_M x BLOCK_N tile of y and walks all of K: each step loads a
BLOCK_N x BLOCK_K int8 tile (contiguous along K, so the loads are coalesced 16-byte vectors),
converts it to x's dtype in registers and feeds the tensor cores with `tl.dot` (M is padded to
16 by masking). The weight is read exactly once; the row scale and bias are applied in the
epilogue. Decode is bound by the weight's bytes, so the tile shapes aim at enough bytes in
flight per SM (BLOCK_N x BLOCK_K x num_stages), not at arithmetic.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# MPINFER_INT8_MAGIC=0 falls back to the conversion unit (a diagnostic switch).
MAGIC_ENABLED = os.environ.get("MPINFER_INT8_MAGIC", "1") != "0"

CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [
        (16, 256, 4, 4),
        (32, 256, 4, 4),
        (32, 512, 4, 3),
        (64, 256, 4, 4),
        (64, 512, 8, 3),
        (128, 256, 8, 3),
        (32, 1024, 8, 2),
    ]
]


@triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K"])
@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    M_BUCKET: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        k_ok = (k + offs_k[None, :]) < K
        x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0)  # (BLOCK_N, BLOCK_K) int8 (or its bytes)
        if MAGIC:
            # int8 -> fp16 without the conversion unit (16 values/clock/SM on Hopper, exactly
            # the rate the weight bytes arrive at): the bytes of q + 128, OR-ed into the
            # mantissa of 1024.0, are the fp16 number 1024 + q + 128; subtract 1152.
            bits = (w ^ 0x80).to(tl.uint16) | 0x6400
            wf = bits.to(tl.float16, bitcast=True) - 1152.0
        else:
            wf = w.to(x.dtype)
        acc = tl.dot(x, tl.trans(wf), acc)  # (BLOCK_M, BLOCK_N), fp32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    n_in = offs_n < N
    acc = acc * tl.load(s_ptr + offs_n, mask=n_in, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok & n_in[None, :])


GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [
        (8, 512, 4, 3),
        (8, 1024, 4, 3),
        (16, 1024, 8, 2),
        (16, 512, 4, 4),
        (8, 2048, 8, 2),
        (32, 512, 8, 3),
        (4, 2048, 4, 3),
        (32, 256, 4, 4),
    ]
]


@triton.autotune(configs=GEMV_CONFIGS, key=["N", "K"])
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One row: y[n] = sum_k x[k] * q[n, k]. No tensor cores (nothing to pad M to): each
    program streams BLOCK_N weight rows with wide loads and reduces along K in registers, so a
    small BLOCK_N gives many programs in flight even for N = 4096."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n[:, None] < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        k_ok = (k + offs_k) < K
        x = tl.load(x_ptr + k + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # (BLOCK_K,)
        w = tl.load(w_ptrs, mask=n_ok & k_ok[None, :], other=0)  # (BLOCK_N, BLOCK_K) int8
        # Reduce every tile: registers hold one tile, so wide tiles (more bytes in flight per
        # program) stay affordable.
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        w_ptrs += BLOCK_K
    n_in = offs_n < N
    y = acc * tl.load(s_ptr + offs_n, mask=n_in, other=0.0)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_in)


def w8a16_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    M, K = x.shape
    N = q.shape[0]
    assert q.shape[1] == K and q.dtype == torch.int8 and q.is_contiguous()
    x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    magic = x.dtype == torch.float16 and MAGIC_ENABLED
    if M == 1 and not magic:
        _gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, q, scale, bias if bias is not None else scale, y, N, K, q.stride(0),
            HAS_BIAS=bias is not None,
        )  # fmt: skip
        return y
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    m_bucket = block_m  # autotune once per row bucket, not per exact M

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, block_m))

    _w8a16_kernel[grid](
        x, q.view(torch.uint8) if magic else q, scale, bias if bias is not None else scale, y,
        M, N, K, x.stride(0), q.stride(0), y.stride(0),
        M_BUCKET=m_bucket, HAS_BIAS=bias is not None, MAGIC=magic, BLOCK_M=block_m,
    )  # fmt: skip
    return y
