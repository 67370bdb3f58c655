"""GPU kernels (Triton), imported only on CUDA. Each has a pure-torch reference in quant.py.

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

import functools

import torch
import torch.nn.functional as F

from ..quant import epilogue
from .tuning import ROW_BUCKETS

DECODE_MAX_ROWS = ROW_BUCKETS[-1]


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def attention_splits(batch: int, heads: int, max_seq: int, sms: int) -> int:
    """Programs per row and head of the decode attention (attention.py), which cuts each row's
    history into this many equal runs of 32-key tiles at run time: enough that batch x heads x
    splits gives every SM about 8 programs (batch 1 with 14 or 32 heads still fills the GPU),
    but no more than the cache has tiles, nor than 32, past which a short history leaves most
    programs empty and the merge grows (bench/results/attention-h200.md). It depends only on
    the batch and the cache length, so a captured graph stays valid."""
    return max(1, min(-(-8 * sms // (batch * heads)), -(-max_seq // 32), 32))


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
