"""What the two weight-only matmul kernels (w8a16.py, w4a16.py) share: the fused epilogue, the
deterministic split-K reduction, the per-device scratch, and the choice of config and grid.

    y = act(acc * scale + bias) + residual      acc: a tile's fp32 sums
    act: none or BLOOM's tanh GeLU; scale: int8's per-row scale (int4 scales inside the loop)

Split-K: each of a tile's `split_k` programs writes its fp32 partial tile to a workspace and
bumps the tile's counter; the last to arrive adds the partials in split order (the same order
every time, so a result never depends on timing), applies the epilogue and resets the counter
for the next launch. The grid is (row tiles, column tiles, splits), row tiles fastest: the
programs that read one weight tile for different rows run side by side and share it in L2, so a
step of 576 rows still reads each weight from HBM about once.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import tuning
from .tuning import COUNTERS, WORKSPACE_BYTES

# Triton's interpreter (CPU tests) runs no PTX: there the kernels' PTX conversions run their
# Triton-op twins, so the CPU tests check the algebra and the GPU tests the PTX.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def finish(acc, mask, n_idx, y_off, r_off, s_ptr, b_ptr, r_ptr, y_ptr, HAS_SCALE: tl.constexpr,
           HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """The epilogue on a tile of fp32 sums of any shape (index tensors of the same shape)."""
    y = acc
    if HAS_SCALE:
        y = y * tl.load(s_ptr + n_idx, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n_idx, mask=mask, other=0.0).to(tl.float32)
    if ACT:  # tanh GeLU: 0.5 y (1 + tanh(z)) = y * sigmoid(2 z), z = sqrt(2/pi) (y + 0.044715 y^3)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    if HAS_RES:
        y += tl.load(r_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_and_finish(
    acc, mask, n_idx, y_off, r_off, ws_off, tile, pid_k, split_k, ws_stride,
    s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    if split_k == 1:
        finish(acc, mask, n_idx, y_off, r_off, s_ptr, b_ptr, r_ptr, y_ptr, HAS_SCALE, HAS_BIAS,
               ACT, HAS_RES)  # fmt: skip
    else:
        tl.store(ws_ptr + pid_k * ws_stride + ws_off, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:  # the last split of this tile: sum all, in split order
            total = tl.load(ws_ptr + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, split_k):
                total += tl.load(ws_ptr + s * ws_stride + ws_off, mask=mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            finish(total, mask, n_idx, y_off, r_off, s_ptr, b_ptr, r_ptr, y_ptr, HAS_SCALE,
                   HAS_BIAS, ACT, HAS_RES)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


_scratch: dict = {}


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_scratch(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace fp32, tile counters int32) of this device, made once; the kernels leave every
    counter at zero, so consecutive launches on a stream (and graph replays) share them."""
    key = device_index(device)
    if key not in _scratch:
        _scratch[key] = (
            torch.empty(WORKSPACE_BYTES // 4, dtype=torch.float32, device=device),
            torch.zeros(COUNTERS, dtype=torch.int32, device=device),
        )
    return _scratch[key]


@functools.cache
def _chosen(index: int, dtype: str, M: int, N: int, K: int, bits: int, group: int) -> str:
    """The table's config for a launch, else the default rule's (once per launch shape)."""
    gpu = torch.cuda.get_device_name(index)
    return tuning.lookup(gpu, dtype, M, N, K, bits=bits, group=group) or tuning.default_config(
        M, N, K, dtype, tuning.sm_count(index), bits=bits, group=group
    )


def launch_plan(x: torch.Tensor, N: int, K: int, config: str | None, *, bits: int,
                group: int = 0) -> tuple[dict, int, int, tuple[int, int, int]]:  # fmt: skip
    """(meta-parameters with BLOCK_M, num_warps, num_stages, grid) of a launch of x's rows by
    N: `config` if given (checked), else the GPU's table, else the default rule."""
    M = x.shape[0]
    dtype = tuning.dtype_name(x.dtype)
    if config is None:
        config = _chosen(device_index(x.device), dtype, M, N, K, bits, group)
    elif why := tuning.illegal(config, M, N, K, dtype, bits=bits, group=group):
        raise ValueError(f"config {config!r} cannot run {M} x {K} by {N} ({dtype}): {why}")
    kw, warps, stages = tuning.parse(config)
    kw = dict(kw, BLOCK_M=tuning.block_m(kw, M))
    if regs := kw.pop("MAXNREG"):  # a launch option (registers a thread), not a meta-parameter
        kw["maxnreg"] = regs
    n_tiles = triton.cdiv(N, kw["BLOCK_N"])
    m_tiles = triton.cdiv(M, kw["BLOCK_M"]) if kw["USE_DOT"] else 1
    assert kw["USE_DOT"] or M == 1, "the one-row loop picked for several rows"
    if kw["split_k"] > 1:
        assert n_tiles * m_tiles <= COUNTERS, "more output tiles than split-K counters"
        assert kw["split_k"] * M * N * 4 <= WORKSPACE_BYTES, "split-K partials over the workspace"
    return kw, warps, stages, (m_tiles, n_tiles, kw["split_k"])
