"""The next matmul's weight into L2 during the decode step's idle memory time.

At small batches a decode step leaves HBM idle in two kinds of windows between the weight-bound
matmuls: the decode attention (a few MB of KV cache per layer, latency-bound: 5-7 us a layer at
batch 1) and the LayerNorms (a few KB, about 2 us a launch with its gap). Kernels in those windows
also ask L2 for the weight of the matmul that follows (`prefetch.global.L2`: one 128-byte line per
lane, no register written, nothing waited for), so that matmul finds part or all of its weight in
L2. The attention asks for the whole dense weight, once its own keys and values are read, when
the weight and the step's KV cache fit in L2 together (else the cache's stream would evict the
weight before use); a LayerNorm asks for the leading LN_BYTES of the QKV or fc1 weight (the rows
its first programs read), from extra programs beside its row programs.

MPINFER_L2_PREFETCH: "all" (default), "attn" (the attention window only) or "0" (off).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MODES = ("all", "attn", "0")
LN_BYTES = 8 << 20  # what HBM moves in about 2 us
LN_PROGRAMS = 64  # extra LayerNorm programs that only prefetch
LINES = tl.constexpr(256)  # lines a program asks for per loop step


def mode() -> str:
    value = os.environ.get("MPINFER_L2_PREFETCH", "all")
    if value not in MODES:
        raise ValueError(f"MPINFER_L2_PREFETCH={value!r}: expected one of {MODES}")
    return value


@functools.cache
def l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def request(weight: torch.Tensor | None, window: str, other_bytes: int = 0):
    """(the weight as bytes, how many of its leading bytes to ask L2 for) in a window of this
    kind ("attn" or "ln"), or None for no prefetch. other_bytes: what the window itself streams
    through L2 (the attention's KV cache)."""
    m = mode()
    if weight is None or not weight.is_cuda or not weight.is_contiguous():
        return None
    if m == "0" or (window == "ln" and m != "all"):
        return None
    size = weight.numel() * weight.element_size()
    if window == "attn":
        index = weight.device.index if weight.device.index is not None else 0
        if size + other_bytes > l2_bytes(index):
            return None
        return weight.view(torch.uint8), size
    return weight.view(torch.uint8), min(size, LN_BYTES)


@triton.jit
def l2_prefetch(ptr, n_bytes, part, parts, BLOCK: tl.constexpr):
    """Ask L2 for part `part` of `parts` (equal runs of 128-byte lines) of [ptr, ptr + n_bytes);
    ptr is a byte pointer, 128-byte aligned."""
    lines = tl.cdiv(n_bytes, 128)
    per = tl.cdiv(lines, parts)
    lo = part * per
    hi = tl.minimum(lo + per, lines)
    for start in range(lo, hi, BLOCK):
        line = tl.minimum(start + tl.arange(0, BLOCK), hi - 1).to(tl.int64)  # tail: repeats
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + line * 128],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
