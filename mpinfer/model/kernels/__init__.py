"""GPU kernels (Triton): this file is Triton-free and imports them only when a launch needs one,
so it imports on a CPU machine. Each kernel has a pure-torch reference in quant.py or model.py.

`int8_linear(x, q, scale, bias)` is the W8A16 matmul `(x @ q^T) * scale + bias` and
`int4_linear(x, packed, scale, offset, bias)` the group-wise W4A16 one:
- up to the GPU's crossover (its tuned table's "dequant_rows", int4's "int4_dequant_rows";
  else DEQUANT_ROWS, 256): one Triton kernel each that reads the quantized weight once and
  converts it in registers (w8a16.py, w4a16.py, launch.py, and on Hopper int8's
  warp-specialized w8a16_tma.py), configured per row bucket by the GPU's tuned table or the
  default rule (tuning.py);
- more rows (a long prefill, a step past the server's step cap): the weight is dequantized
  into a compute-dtype temporary for this one matmul (dequant.py: 1 byte read and 2 written
  per weight) and cuBLAS multiplies. Measured on the H200 in round 4 (docs/performance.md): at
  512-576 rows the in-register kernels then reached about 300 TFLOP/s against cuBLAS's 620, so
  the temporary's extra bytes cost less than the slower matmul (bloom-7b1 fc2 at 576 rows: 277
  us in-register, about 175 dequantized). On the H100, with 256-row tiles, a 512-token step ran
  faster in registers (round 7), so its table says 512. Dequantizing first (not scaling the
  output) keeps fp16 products of int8 values (up to 127 * sqrt(K)) from overflowing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .tuning import dequant_rows


def epilogue(y: torch.Tensor, *, gelu: bool, residual: torch.Tensor | None) -> torch.Tensor:
    """BLOOM's elementwise neighbours of a linear layer, as separate torch ops: its GeLU (the
    tanh approximation; 0.79788456 is sqrt(2/pi) to 8 digits, and torch computes it in one
    pass) and the residual add. What the GPU kernels do in their own epilogue; the reference
    path (quant.py) uses it too."""
    if gelu:
        y = F.gelu(y, approximate="tanh")
    return y + residual if residual is not None else y


# Launches of more rows than this dequantize their weight for cuBLAS (the module docstring),
# unless the GPU's tuned table names its own measured crossover ("dequant_rows": the H100's is
# 512, so a step of up to 512 tokens, the server's default cap, runs in registers).
DEQUANT_ROWS = 256
# A diagnostic override of every GPU's crossover (tools/diag/mixed_step.py --dequant-rows).
FORCE_DEQUANT_ROWS: int | None = None


@functools.cache
def _table_rows(index: int, bits: int) -> int:
    return dequant_rows(torch.cuda.get_device_name(index), bits) or DEQUANT_ROWS


def _many(x: torch.Tensor, *, bits: int) -> bool:
    """Whether a launch of x's rows dequantizes its weight for cuBLAS (GPU activations): past
    the table's crossover for this weight width (int8's and int4's are measured apart)."""
    rows = x.numel() // x.shape[-1]
    if FORCE_DEQUANT_ROWS is not None:
        return rows > FORCE_DEQUANT_ROWS
    if rows <= DEQUANT_ROWS or not x.is_cuda:
        return rows > DEQUANT_ROWS
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return rows > _table_rows(index, bits)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.numel() // x.shape[-1], x.shape[-1])


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
    gpu = x.dtype in (torch.float16, torch.bfloat16)
    if gpu and _many(x, bits=8):
        from .dequant import dequantize

        y = F.linear(x, dequantize(q, scale, x.dtype), bias)
        return epilogue(y, gelu=gelu, residual=residual)
    if gpu:
        from .w8a16 import w8a16_matmul

        y = w8a16_matmul(_rows(x), q, scale, bias, gelu=gelu, residual=residual)
        return y.reshape(*x.shape[:-1], q.shape[0])
    y = F.linear(x, q.to(x.dtype), None) * scale + (0 if bias is None else bias)  # fp32
    return epilogue(y, gelu=gelu, residual=residual)


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gelu(x @ w^T + bias) + residual` for group-wise int4 w (quant.py's format), x fp16 or
    bf16 (quant.py's reference computes the rest)."""
    if _many(x, bits=4):
        from .dequant import dequantize_int4

        y = F.linear(x, dequantize_int4(packed, scale, offset, x.dtype), bias)
        return epilogue(y, gelu=gelu, residual=residual)
    from .w4a16 import w4a16_matmul

    y = w4a16_matmul(_rows(x), packed, scale, offset, bias, gelu=gelu, residual=residual)
    return y.reshape(*x.shape[:-1], packed.shape[0])
