"""GPU kernels (Triton): this file is Triton-free and imports them only when a launch needs one,
so it imports on a CPU machine. Each kernel has a pure-torch reference in quant.py or model.py.

`int8_linear(x, q, scale, bias)` is the W8A16 matmul `(x @ q^T) * scale + bias`:
- few rows (decode, M <= DECODE_MAX_ROWS): one Triton kernel that streams the int8 weight once
  and converts it in registers, configured per row bucket (ROW_BUCKETS) by the GPU's tuned
  table or else by the autotuner; see w8a16.py and tuning.py.
- many rows (prefill): the weight is dequantized into a compute-dtype temporary (one Triton
  pass, 1 byte read and 2 written per weight; dequant.py) and cuBLAS does the matmul; at 2048
  rows the pass costs a few percent of the matmul. Dequantizing first (not scaling the output)
  keeps fp16 products of int8 values (up to 127 * sqrt(K)) from overflowing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .tuning import ROW_BUCKETS

DECODE_MAX_ROWS = ROW_BUCKETS[-1]


def epilogue(y: torch.Tensor, *, gelu: bool, residual: torch.Tensor | None) -> torch.Tensor:
    """BLOOM's elementwise neighbours of a linear layer, as separate torch ops: its GeLU (the
    tanh approximation; 0.79788456 is sqrt(2/pi) to 8 digits, and torch computes it in one
    pass) and the residual add. What the GPU decode kernel does in its own epilogue; the
    reference path (quant.py) uses it too."""
    if gelu:
        y = F.gelu(y, approximate="tanh")
    return y + residual if residual is not None else y


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
