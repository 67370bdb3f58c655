"""The quantized weight formats and the linear methods that own a layer's matmul.

int8: symmetric per output row, `scale = absmax / 127` (float32), `w ~= q * scale[:, None]`.
int4: per group of G consecutive inputs (quant.group_size), round to nearest, from the
checkpoint's weights; `w ~= q * scale[g] + offset[g]` with q in 0..15 and scale, offset fp16 per
(group, row), stored group-major [in / G, out] (a kernel tile's scales are contiguous).
Asymmetric (the default): offset = the group's min, scale = range / 15. Symmetric: scale =
absmax / 7, offset = -8 scale (q - 8 in -8..7). Packed two a byte: group g of a row is G/2
bytes, byte b holding input g G + b (low nibble) and g G + G/2 + b (high nibble), so a kernel's
K tile of one group pairs each nibble half with a contiguous half of x.

A TP layer (layers.py) owns slicing and its one collective; a `LinearMethod` owns the weights'
storage and the matmul, vLLM's `quant_method.apply` split:

    DenseMethod   compute-dtype weight, F.linear
    Int8Method    weight-only int8 (W8A16): int8 weight + row scales; the pure-torch reference
                  here, the Triton kernels (kernels/) on CUDA when they are available
    Int4Method    weight-only group-wise int4 (W4A16): packed weight, scales and offsets; the
                  reference dequantizes and calls F.linear, the GPU runs kernels/w4a16.py
    BnbInt8Method bitsandbytes LLM.int8() (int8 activations, fp16 outlier columns); the same
                  stored int8 + scales, so one sharded file serves both int8 methods

What is not here: slicing (sharding.py) and collectives (layers.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from ..extras import require
from .kernels import epilogue, int4_linear, int8_linear


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale float32 [out]); an all-zero row gets scale 1 and q 0."""
    w = w.float()
    absmax = w.abs().amax(dim=-1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(w: torch.Tensor, group: int, *, symmetric: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(packed uint8 [out, in/2], scale fp16 [in/group, out], offset fp16 [in/group, out]) of
    w [out, in] (the module docstring's format). q is rounded against the stored fp16 scale and
    offset, so dequantizing what is stored is the closest value the format holds."""
    N, K = w.shape
    if K % group or group % 2:
        raise ValueError(f"int4: {K} input features are not a multiple of quant.group_size="
                         f"{group}")  # fmt: skip
    g = w.float().reshape(N, K // group, group)
    if symmetric:
        scale = g.abs().amax(-1) / 7
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15
    scale = scale.half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0
    offset = (-8 * scale) if symmetric else lo.half()
    q = torch.round((g - offset.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    q = q.to(torch.uint8)
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # (N, K / group, group / 2)
    return packed.reshape(N, K // 2).contiguous(), scale.T.contiguous(), offset.T.contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                    ) -> torch.Tensor:  # fmt: skip
    """The fp32 weight [out, in] a packed int4 weight stands for."""
    groups, N = scale.shape
    half = packed.shape[1] // groups
    p = packed.reshape(N, groups, half)
    q = torch.cat([p & 0xF, p >> 4], dim=-1).float()  # (N, groups, group)
    s, z = scale.float().T[..., None], offset.float().T[..., None]  # (N, groups, 1)
    return (q * s + z).reshape(N, 2 * half * groups)


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    # Built under torch.device("meta") by the model; the loader assigns real tensors.
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class LinearMethod(ABC):
    """Creates a layer's weight storage and computes `x @ W^T (+ bias)` for it."""

    is_quantized = False
    # Whether its decode matmul can be captured in a CUDA graph (static shapes, no host syncs).
    supports_cuda_graphs = True

    @abstractmethod
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype):
        """Set the layer's (meta) parameters for a [out_features, in_features] weight."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features)."""

    def apply_fused(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        gelu: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`gelu(x @ W^T + bias) + residual`: the matmul with BLOOM's elementwise neighbours,
        which a kernel may fuse into its epilogue (here: separate torch ops)."""
        return epilogue(self.apply(layer, x, bias), gelu=gelu, residual=residual)

    def after_load(self, layer: nn.Module) -> None:
        """Hook once real tensors are in place (e.g. build a backend's state)."""

    @abstractmethod
    def weight_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the compute dtype (embedding lookup of a tied weight)."""


class DenseMethod(LinearMethod):
    def create_weights(self, layer, out_features, in_features, dtype):
        layer.weight = _empty((out_features, in_features), dtype)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)

    def weight_rows(self, layer, ids):
        return F.embedding(ids, layer.weight)


class Int8Method(LinearMethod):
    is_quantized = True

    def __init__(self, *, use_kernels: bool = True):
        self.use_kernels = use_kernels

    def create_weights(self, layer, out_features, in_features, dtype):
        layer.weight = _empty((out_features, in_features), torch.int8)
        layer.weight_scale = _empty((out_features,), torch.float32)
        layer.compute_dtype = dtype

    def apply(self, layer, x, bias):
        if self.use_kernels and x.is_cuda:  # Triton kernels (imported on a GPU only)
            return int8_linear(x, layer.weight, layer.weight_scale, bias)
        return int8_linear_reference(x, layer.weight, layer.weight_scale, bias)

    def apply_fused(self, layer, x, bias, *, gelu=False, residual=None):
        if self.use_kernels and x.is_cuda:
            return int8_linear(
                x, layer.weight, layer.weight_scale, bias, gelu=gelu, residual=residual
            )
        return super().apply_fused(layer, x, bias, gelu=gelu, residual=residual)

    def weight_rows(self, layer, ids):
        rows = F.embedding(ids, layer.weight).to(layer.compute_dtype)
        return rows * F.embedding(ids, layer.weight_scale[:, None]).to(layer.compute_dtype)


def int8_linear_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The pure-torch W8A16 matmul every kernel is compared with: (x @ q^T) * scale + bias."""
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return y + bias if bias is not None else y


class Int4Method(LinearMethod):
    is_quantized = True

    def __init__(self, *, group_size: int = 128, use_kernels: bool = True):
        self.group_size = group_size
        self.use_kernels = use_kernels

    def create_weights(self, layer, out_features, in_features, dtype):
        groups = in_features // self.group_size
        layer.weight = _empty((out_features, in_features // 2), torch.uint8)
        layer.weight_scale = _empty((groups, out_features), torch.float16)
        layer.weight_offset = _empty((groups, out_features), torch.float16)
        layer.compute_dtype = dtype

    def apply(self, layer, x, bias):
        return self.apply_fused(layer, x, bias)

    def apply_fused(self, layer, x, bias, *, gelu=False, residual=None):
        w = (layer.weight, layer.weight_scale, layer.weight_offset)
        if self.use_kernels and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            return int4_linear(x, *w, bias, gelu=gelu, residual=residual)
        y = F.linear(x, dequantize_int4(*w).to(x.dtype), bias)  # the reference
        return epilogue(y, gelu=gelu, residual=residual)

    def weight_rows(self, layer, ids):
        flat = ids.reshape(-1)
        w = (layer.weight[flat], layer.weight_scale[:, flat], layer.weight_offset[:, flat])
        return dequantize_int4(*w).reshape(*ids.shape, -1).to(layer.compute_dtype)


class BnbInt8Method(Int8Method):
    """bitsandbytes LLM.int8(): activations quantized per row, outlier columns kept in fp16."""

    # Outlier columns are found per call (data-dependent shapes): no CUDA graph.
    supports_cuda_graphs = False

    def __init__(self, *, threshold: float):
        super().__init__(use_kernels=False)
        self.threshold = threshold

    def after_load(self, layer):
        from bitsandbytes.autograd._functions import MatmulLtState

        state = MatmulLtState()
        state.CB = layer.weight.data
        state.SCB = (layer.weight_scale.data * 127.0).float()  # bnb keeps the row absmax
        state.has_fp16_weights = False
        state.threshold = self.threshold
        state.is_training = False
        layer.bnb_state = state

    def apply(self, layer, x, bias):
        import bitsandbytes as bnb

        # bitsandbytes quantizes activations from fp16 (and warns on any other dtype).
        y = bnb.matmul(x.half(), layer.weight, state=layer.bnb_state, threshold=self.threshold)
        y = y.to(x.dtype)
        return y + bias if bias is not None else y


def make_linear_method(method: str, *, threshold: float = 6.0, group_size: int = 128
                       ) -> LinearMethod:  # fmt: skip
    if method == "none":
        return DenseMethod()
    if method == "int8":
        return Int8Method()
    if method == "int4":
        return Int4Method(group_size=group_size)
    if method == "llm.int8":
        require("bitsandbytes")  # a clear error naming the extra, before any weight moves
        return BnbInt8Method(threshold=threshold)
    raise ValueError(f"quant.method={method!r}: expected int8, int4, llm.int8 or none")
