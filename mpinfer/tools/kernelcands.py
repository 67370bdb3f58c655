"""Other libraries' weight-only matmuls, timed beside mpinfer's in `mpinfer bench kernels
--candidates ...` (the issue's rule: adopt one as a dependency only if it beats our kernel and
runs on the GPU machine's torch and Triton; the table goes to docs/performance.md either way).

Each candidate quantizes the same fp16 weight its own way (int8 per row, or int4 in groups with
a zero point) and is timed like ours: a CUDA graph cycling through enough copies to miss L2, or,
where a library's call cannot be captured, eagerly with CUDA events (said in the result). A
library that is not installed, or fails on this GPU, gives the error's first words instead of a
time: nothing here is imported by the product.

    torch-int8pack   torch._weight_int8pack_mm (torch's own W8A16 op)
    torchao-int8wo   torchao's Int8WeightOnlyConfig on an nn.Linear, eager (no torch.compile)
    gemlite-a16w8    gemlite's A16W8 (Triton), int8 per output row
    gemlite-a16w4    gemlite's A16W4 (Triton), int4 groups with zero points
    humming-w8       humming-kernels' int8 layer (NVRTC-compiled CUDA)
    humming-w4       humming-kernels' uint4 layer with groups and zero points
"""

from __future__ import annotations

import torch

from ..model.quant import quantize_rows

CANDIDATES = {"torch-int8pack": 8, "torchao-int8wo": 8, "gemlite-a16w8": 8, "humming-w8": 8,
              "gemlite-a16w4": 4, "humming-w4": 4}  # fmt: skip


def _int4_groups(w: torch.Tensor, group: int):
    """(q uint8 0..15 [N, K], scale [N, K/group], zero [N, K/group]) with w ~ (q - zero) scale."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = -lo / scale
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), scale, zero


def build(cand: str, w: torch.Tensor, bias: torch.Tensor | None, group: int):
    """A callable x -> y for the candidate, from the fp16/bf16 weight w [N, K]."""
    N, K = w.shape
    dtype = w.dtype
    if cand == "torch-int8pack":
        q, scale = quantize_rows(w)
        s = scale.to(dtype)

        def call(x):
            y = torch._weight_int8pack_mm(x, q, s)
            return y + bias if bias is not None else y

        return call
    if cand == "torchao-int8wo":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        lin = torch.nn.Linear(K, N, bias=bias is not None, device=w.device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if bias is not None:
                lin.bias.copy_(bias)
        quantize_(lin, Int8WeightOnlyConfig())
        return lin
    if cand == "gemlite-a16w8":
        from gemlite.helper import A16W8_INT8

        return A16W8_INT8(device=str(w.device), dtype=dtype).from_weights(w, bias)
    if cand == "gemlite-a16w4":
        from gemlite.helper import A16W4_HQQ_INT

        q, scale, zero = _int4_groups(w, group)
        return A16W4_HQQ_INT(device=str(w.device), dtype=dtype).from_weights(
            q, scale.to(dtype), zero.to(dtype), bias
        )
    if cand.startswith("humming"):
        from humming.layer import HummingLayer

        cfg = ({"dtype": "int8"} if cand == "humming-w8"
               else {"dtype": "uint4", "group_size": group, "has_zero_point": True})  # fmt: skip
        layer = HummingLayer(shape_n=N, shape_k=K, weight_config=cfg,
                             has_bias=bias is not None, torch_dtype=dtype)  # fmt: skip
        layer = layer.to(w.device)
        layer.load_from_unquantized(w)
        if bias is not None:
            layer.bias.data.copy_(bias)
        layer.transform()
        return layer
    raise ValueError(f"unknown candidate {cand!r}: one of {list(CANDIDATES)}")


def time_candidate(cand, w, bias, x, group, copies: int, graph_time_us) -> float | str:
    """Microseconds per call (`graph_time_us`: a CUDA graph over `copies` copies, enough to
    miss L2; eager events where the library cannot be captured: then the result is 'eager
    N.N'), or why it could not run."""
    n = copies
    try:
        calls = [build(cand, w, bias, group) for _ in range(n)]
        for c in calls:  # a library's own autotuning and compilation, outside any timing
            c(x)
        torch.cuda.synchronize()
    except Exception as e:  # not installed, or not on this GPU / torch / Triton
        return f"{type(e).__name__}: {e}"[:160]
    try:
        return graph_time_us(lambda i: calls[i](x), n)
    except Exception as e:  # cannot be captured: time it eagerly
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            start.record()
            for i in range(20 * n):
                calls[i % n](x)
            end.record()
            torch.cuda.synchronize()
        except Exception:
            return f"{type(e).__name__}: {e}"[:160]
        return f"eager {start.elapsed_time(end) * 1e3 / (20 * n):.1f}"
