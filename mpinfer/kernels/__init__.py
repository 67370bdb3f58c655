"""GPU kernels (Triton), imported only on CUDA. Each has a pure-torch reference in quant.py.

`int8_linear(x, q, scale, bias)` is the W8A16 matmul `(x @ q^T) * scale + bias`:
- few rows (decode, M <= DECODE_MAX_ROWS): Triton kernels that stream the int8 weight once and
  convert it in registers: a GEMV for one row, tensor-core tiles for 2..64 rows; see w8a16.py.
- many rows (prefill): the weight is dequantized into a compute-dtype temporary (one Triton
  pass, 1 byte read and 2 written per weight; dequant.py) and cuBLAS does the matmul; at 2048
  rows the pass costs a few percent of the matmul. Dequantizing first (not scaling the output)
  keeps fp16 products of int8 values (up to 127 * sqrt(K)) from overflowing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import epilogue

DECODE_MAX_ROWS = 64


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gelu((x @ q^T) * scale + bias) + residual` (gelu and residual optional)."""
    rows = x.numel() // x.shape[-1]
    if x.dtype in (torch.float16, torch.bfloat16) and rows <= DECODE_MAX_ROWS:
        from .w8a16 import w8a16_matmul

        y = w8a16_matmul(x.reshape(rows, x.shape[-1]), q, scale, bias, gelu=gelu, residual=residual)
        return y.reshape(*x.shape[:-1], q.shape[0])
    if x.dtype in (torch.float16, torch.bfloat16):
        from .dequant import dequantize

        y = F.linear(x, dequantize(q, scale, x.dtype), bias)
    else:  # fp32 on a GPU: the reference
        y = F.linear(x, q.to(x.dtype), None) * scale + (0 if bias is None else bias)
    return epilogue(y, gelu=gelu, residual=residual)
