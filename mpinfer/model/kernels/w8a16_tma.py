"""The W8A16 matmul's warp-specialized loop for many rows (Hopper): `tma` configs.

The swap loop of w8a16.py (y^T = w @ x^T, the converted int8 tile as the tensor cores' register
operand) with its tiles brought in by the TMA engine and its K loop split by Triton's Hopper warp
specialization (`tl.range(..., warp_specialize=True)`; checked with Triton 3.6 and 3.9, four warps
a partition): a producer warp group issues the copies of the int8 weight tile and of x's tile into
a ring of shared-memory stages, and two consumer warp groups, half of the weight rows each,
convert their half in registers and run the tensor cores. cuBLAS's Hopper kernels take this shape
(a producer feeding two consumers); the pointer-loaded loop cannot: its barriers and conversions
stall the same warps that issue the products, and Triton warp-specializes a loop only when its
loads are tensor descriptors and it runs four warps (with eight it compiles the plain loop). The
epilogue (scale, bias, GeLU, residual) is the other loops' on the transposed tile, so each row of
y is stored whole. Split K (`splitS`) takes a second launch: Triton warp-specializes no loop
whose epilogue has launch.py's split-K counters, so each split stores its fp32 partial tile to
the workspace and `split_finish` adds the splits in order (deterministic) and applies the
epilogue, elementwise. At 128-256 rows a long K and a short N give too few tiles to fill the
GPU without it (round 14: the pointer-loaded loops, which split, won those launches).

The copies' descriptors are made in the kernel (in global scratch memory that
`descriptor_scratch` hands Triton); they need 16-byte aligned bases and rows (K % 16 == 0) and
fill rows past M or N and columns past K with zeros.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .launch import device_scratch, finish
from .w8a16_convert import _to_compute

log = logging.getLogger("mpinfer")
# tma kernels (BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, stages, split) this process's Triton could not
# build: their launches run the same tile in the pointer-loaded swap loop
TMA_UNBUILT: dict[tuple, str] = {}


@triton.jit(do_not_specialize=["split_k"])
def _w8a16_tma(
    x_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr,
    M, N, K, stride_xm, stride_ym, stride_rm, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, MAGIC: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)  # row tiles fastest: they share each weight tile in L2
    pid_n = tl.program_id(1)
    k_lo, k_hi = split_bounds(K, BLOCK_K, split_k)
    cdt = x_ptr.dtype.element_ty
    # made in the kernel, not by the launcher: Triton's partitioner cuts the weight tile's copy
    # into the consumers' halves and gives them descriptors of that block (a launcher's
    # descriptor keeps the whole tile's block: Triton 3.6 then copies twice the bytes its
    # barriers expect, 3.9 refuses to compile)
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES, warp_specialize=True):
        w = w_desc.load([pid_n * BLOCK_N, k])  # (BLOCK_N, BLOCK_K) int8
        x = x_desc.load([pid_m * BLOCK_M, k])  # (BLOCK_M, BLOCK_K)
        acc_t = tl.dot(_to_compute(w, cdt, MAGIC), tl.trans(x), acc_t)  # (BLOCK_N, BLOCK_M)
    # the output tile y (BLOCK_M, BLOCK_N): the scale and bias as vectors, rows stored whole;
    # SPLIT: the split's partial sums to the workspace instead (`split_finish` adds them)
    y = tl.trans(acc_t)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    mask = (offs_m[:, None] < M) & n_ok[None, :]
    if SPLIT:
        tl.store(ws_ptr + tl.program_id(2) * M * N + offs_m[:, None] * N + offs_n[None, :], y,
                 mask=mask)  # fmt: skip
    else:
        y = y * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT:  # tanh GeLU as launch.finish has it
            y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
        if HAS_RES:
            y += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask,
                         other=0.0).to(tl.float32)  # fmt: skip
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def w8a16_tma_matmul(x, q, scale, bias, gelu, residual, y, kw, stages, grid) -> torch.Tensor:
    """Launch a `tma` config (w8a16_matmul's arguments, its launch plan; 4 warps)."""
    assert q.data_ptr() % 16 == 0 and x.shape[1] % 16 == 0, "tma: weight rows not 16-byte aligned"
    M, K = x.shape
    N = y.shape[1]
    if x.data_ptr() % 16 or x.stride(0) % 8:  # copies need 16-byte aligned bases and rows
        x = x.clone()
    descriptor_scratch(x.device)
    ws = device_scratch(x.device)[0]
    split = kw["split_k"]
    _w8a16_tma[grid](
        x, q, scale, bias if bias is not None else y, residual if residual is not None else y, y,
        ws, M, N, K, x.stride(0), y.stride(0), residual.stride(0) if residual is not None else 0,
        split, BLOCK_M=kw["BLOCK_M"], BLOCK_N=kw["BLOCK_N"], BLOCK_K=kw["BLOCK_K"],
        STAGES=stages, HAS_BIAS=bias is not None, ACT=gelu, HAS_RES=residual is not None,
        MAGIC=kw["MAGIC"], SPLIT=split > 1, num_warps=4, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        split_finish(ws, split, scale, bias, gelu, residual, y)
    return y


@triton.jit
def split_bounds(K, BLOCK_K: tl.constexpr, split_k):
    """[k_lo, k_hi) of this program's split of K: whole K tiles, as evenly as they go (the
    last split may be shorter, or empty: its partial sums are then zeros)."""
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k) * BLOCK_K
    k_lo = tl.program_id(2) * per
    return k_lo, tl.minimum(K, k_lo + per)


@triton.jit
def _split_finish(ws_ptr, s_ptr, b_ptr, r_ptr, y_ptr, M, N, split_k, stride_ym, stride_rm,
                  BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                  ACT: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(split_k):  # in split order: the same sum every time
        acc += tl.load(ws_ptr + i * M * N + offs, mask=ok, other=0.0)
    finish(acc, ok, n, m * stride_ym + n, m * stride_rm + n, s_ptr, b_ptr, r_ptr, y_ptr,
           True, HAS_BIAS, ACT, HAS_RES)  # fmt: skip


def split_finish(ws, split, scale, bias, gelu, residual, y) -> None:
    """The second launch of a split `tma` config: the splits' partial sums (ws, split x M x N
    fp32) added in order, then the epilogue, into y."""
    M, N = y.shape
    BLOCK = 1024
    _split_finish[(triton.cdiv(M * N, BLOCK),)](
        ws, scale, bias if bias is not None else y, residual if residual is not None else y, y,
        M, N, split, y.stride(0), residual.stride(0) if residual is not None else 0,
        BLOCK=BLOCK, HAS_BIAS=bias is not None, ACT=gelu,
        HAS_RES=residual is not None, num_warps=4,
    )  # fmt: skip


def try_tma(launch, x: torch.Tensor, kw: dict, stages: int, config: str | None):
    """launch() (a `tma` config's kernel) -> its output; None where this Triton cannot build the
    family (recorded in TMA_UNBUILT with a warning, once): the caller then runs the tile in its
    pointer-loaded swap loop. Out of memory, and any failure inside a CUDA graph capture (the
    launch ran eagerly first), are raised."""
    family = (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["MAGIC"], stages, kw["split_k"] > 1)
    if family in TMA_UNBUILT:
        return None
    try:
        return launch()
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, AttributeError, triton.CompilationError) as e:
        # a Triton that cannot build it (the partitioner is recent)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        TMA_UNBUILT[family] = f"{type(e).__name__}: {str(e)[:300]}"
        log.warning("tma config %s does not build on Triton %s (%s): the pointer-loaded swap "
                    "loop of its tile runs instead", config or "from the table",
                    triton.__version__, TMA_UNBUILT[family])  # fmt: skip
        return None


_allocators: dict = {}  # device -> the allocator Triton gets for its launches


def descriptor_scratch(device: torch.device) -> None:
    """Give Triton the global memory in-kernel descriptors are written to (128 bytes each, two a
    program): a buffer a device, made at the first launch and grown by a new one (the old ones
    kept: a captured CUDA graph holds their pointers) when a launch needs more; never during a
    capture (the engine and the benchmarks run every launch eagerly first). Launches on one
    stream run in order, so they share it. Set before every launch: Triton keeps its allocator
    in a context variable, which a thread that did not set it does not see."""
    key = str(device) if device.type != "cuda" or device.index is not None else \
        f"cuda:{torch.cuda.current_device()}"  # fmt: skip
    if key not in _allocators:
        bufs: list[torch.Tensor] = []  # newest last; none is ever freed

        def alloc(size: int, alignment: int, stream):
            if not bufs or bufs[-1].numel() < size:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    why = "run the launch once before capturing"
                    raise RuntimeError(f"tma: {size} bytes of descriptors asked for in a CUDA "
                                       f"graph capture ({why})")  # fmt: skip
                bufs.append(torch.empty(max(size, 1 << 20), dtype=torch.uint8, device=device))
            return bufs[-1]

        _allocators[key] = alloc
    triton.set_allocator(_allocators[key])
