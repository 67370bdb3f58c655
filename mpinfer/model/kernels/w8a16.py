"""W8A16 matmul for few rows (decode), in Triton, with split-K and a fused epilogue:

    y = act((x @ q^T) * scale + bias) + residual

    x (M, K) fp16/bf16    q (N, K) int8, row-major    scale (N,) fp32    y (M, N) x.dtype
    act: none or BLOOM's tanh GeLU          residual (M, N), optional

Decode reads every weight byte once and does almost no arithmetic per byte, so the kernel's job
is to keep enough loads in flight on every SM. Two things decide that:
- Grid size. A program owns a BLOCK_N slice of outputs; with N = 4096 and BLOCK_N = 32 that is
  128 programs, fewer than the H200's 132 SMs. Split-K cuts K into `split_k` runs, one program
  each, so small-N matrices still fill the GPU. The partial sums meet deterministically: each
  program writes its fp32 partial tile to a workspace and bumps a per-tile counter; the last
  to arrive adds the partials in split order (the same order every time, so a result never
  depends on timing), applies the epilogue and resets the counter for the next launch.
- Loads ahead of use: Triton's software pipelining (num_stages) for the tensor-core loop; the
  one-row loop, which Triton does not pipeline, may load the next tile before it converts and
  multiplies the current one (PREFETCH).

Three inner loops; which one, with which tiles and split, is per (dtype, rows bucket, N, K): from
the GPU's tuned table (tuning.py) where it has the launch, else from the autotuner:
- USE_DOT: a BLOCK_N x BLOCK_K int8 tile is converted in registers and fed to the tensor cores
  (`tl.dot`, rows padded to 16 by masking). How int8 becomes float is the config's MAGIC
  (`_to_compute`): for fp16 the bit trick in packed PTX wins almost everywhere.
- USE_DOT and SWAP (several rows): the same, computing y^T = w @ x^T, so the converted weight
  tile is the left operand, which the tensor cores read from registers.
- not USE_DOT (one row only): products accumulate elementwise in a BLOCK_N x BLOCK_K fp32 tile
  and are reduced across K once, after the loop (no cross-thread reduction per step).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import tuning
from .tuning import COUNTERS, WORKSPACE_BYTES, sm_count


def magic_enabled() -> bool:
    """MPINFER_INT8_MAGIC=0 (a diagnostic switch, docs/performance.md) keeps the autotuner to
    the int8 conversion through fp32 (MAGIC 0) instead of the bit tricks."""
    return os.environ.get("MPINFER_INT8_MAGIC", "1") != "0"


def _configs() -> list[triton.Config]:
    """The autotuner's candidates: AUTOTUNE_FAMILIES x AUTOTUNE_SPLITS x the conversions
    (_prune keeps AUTOTUNE_MAGIC's for the launch's dtype)."""
    out = []
    for text in tuning.names(tuning.AUTOTUNE_FAMILIES, tuning.AUTOTUNE_SPLITS, "float16"):
        kw, warps, stages = tuning.parse(text)
        out.append(triton.Config(kw, num_warps=warps, num_stages=stages))
    return out


def _prune(configs, named_args, **kwargs):
    """Keep configs that are legal for this launch and give the GPU work to overlap: at least
    half an SM's worth of programs, no split shorter than one tile."""
    M, N, K = named_args["M"], named_args["N"], named_args["K"]
    block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
    sms = sm_count(named_args["x_ptr"].device.index)
    dtype = tuning.dtype_name(named_args["x_ptr"].dtype)
    magics = tuning.AUTOTUNE_MAGIC[dtype] if magic_enabled() else (0,)
    keep = []
    for c in configs:
        kw = c.kwargs
        if kw["MAGIC"] not in magics:
            continue
        if tuning.illegal(tuning.name(kw, c.num_warps, c.num_stages), M, N, K, dtype):
            continue
        programs = triton.cdiv(N, kw["BLOCK_N"]) * kw["split_k"] * triton.cdiv(M, block_m)
        if programs * 2 < sms and kw["split_k"] < 8 or programs > 256 * sms:
            continue
        keep.append(c)
    return keep or configs[:1]


@triton.jit
def _finish(acc, mask, n_idx, y_off, r_off, s_ptr, b_ptr, r_ptr, y_ptr,
            HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """The epilogue on a tile of fp32 sums of any shape (index tensors of the same shape)."""
    y = acc * tl.load(s_ptr + n_idx, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n_idx, mask=mask, other=0.0).to(tl.float32)
    if ACT:  # tanh GeLU: 0.5 y (1 + tanh(z)) = y * sigmoid(2 z), z = sqrt(2/pi) (y + 0.044715 y^3)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    if HAS_RES:
        y += tl.load(r_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_and_finish(
    acc, mask, n_idx, y_off, r_off, ws_off, tile, pid_k, split_k, ws_stride,
    s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    if split_k == 1:
        _finish(acc, mask, n_idx, y_off, r_off, s_ptr, b_ptr, r_ptr, y_ptr, HAS_BIAS, ACT, HAS_RES)
    else:
        tl.store(ws_ptr + pid_k * ws_stride + ws_off, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:  # the last split of this tile: sum all, in split order
            total = tl.load(ws_ptr + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, split_k):
                total += tl.load(ws_ptr + s * ws_stride + ws_off, mask=mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            _finish(total, mask, n_idx, y_off, r_off, s_ptr, b_ptr, r_ptr, y_ptr,
                    HAS_BIAS, ACT, HAS_RES)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


# Packed int8 conversions in PTX, four weights per call (MAGIC=2; NVIDIA only). One `xor` makes
# the four signed bytes offset-binary (q + 128); `prmt` then places each byte under a constant
# exponent, so the bits are a float whose value is a fixed offset plus q + 128, and one subtract
# (two lanes at a time for fp16) leaves q exactly. No conversion-unit instruction (the int8 ->
# float conversion runs at 16 values per clock per SM on Hopper, about the rate the weight bytes
# arrive at), and no per-byte unpacking: 5 instructions per 4 weights for fp16, 9 for fp32.
# fp16: 0x64XX is 1024 + XX, so subtract 1152 (0x6480) from both lanes.
_S8_TO_F16 = tl.constexpr("""{
.reg .b32 u, c;
xor.b32 u, $2, 0x80808080;
prmt.b32 $0, u, 0x64646464, 0x4140;
prmt.b32 $1, u, 0x64646464, 0x4342;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
}""")
# fp32: 0x4B0000XX is 2^23 + XX, so subtract 2^23 + 128.
_S8_TO_F32 = tl.constexpr("""{
.reg .b32 u;
xor.b32 u, $4, 0x80808080;
prmt.b32 $0, u, 0x4B000000, 0x7540;
prmt.b32 $1, u, 0x4B000000, 0x7541;
prmt.b32 $2, u, 0x4B000000, 0x7542;
prmt.b32 $3, u, 0x4B000000, 0x7543;
sub.f32 $0, $0, 0f4B000080;
sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080;
sub.f32 $3, $3, 0f4B000080;
}""")
# bf16: the fp32 values' upper halves, exact for integers of at most 8 significant bits.
_S8_TO_BF16 = tl.constexpr("""{
.reg .b32 u, f<4>;
xor.b32 u, $2, 0x80808080;
prmt.b32 f0, u, 0x4B000000, 0x7540;
prmt.b32 f1, u, 0x4B000000, 0x7541;
prmt.b32 f2, u, 0x4B000000, 0x7542;
prmt.b32 f3, u, 0x4B000000, 0x7543;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
prmt.b32 $0, f0, f1, 0x7632;
prmt.b32 $1, f2, f3, 0x7632;
}""")


@triton.jit
def _to_compute(w, dtype: tl.constexpr, MAGIC: tl.constexpr):
    """An int8 tile as `dtype` (fp16, bf16, or fp32 for the one-row loop), by MAGIC's route."""
    if MAGIC == 2:
        if dtype == tl.float16:
            return tl.inline_asm_elementwise(_S8_TO_F16, "=r,=r,r", [w], dtype=tl.float16,
                                             is_pure=True, pack=4)  # fmt: skip
        elif dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(_S8_TO_BF16, "=r,=r,r", [w], dtype=tl.bfloat16,
                                             is_pure=True, pack=4)  # fmt: skip
        else:
            return tl.inline_asm_elementwise(_S8_TO_F32, "=r,=r,=r,=r,r", [w], dtype=tl.float32,
                                             is_pure=True, pack=4)  # fmt: skip
    elif MAGIC == 1:
        # The same fp16 trick in Triton's elementwise ops, one weight at a time (fp16 only): the
        # bytes of q + 128, OR-ed into the mantissa of 1024.0, are the fp16 number
        # 1024 + q + 128; subtract 1152.
        bits = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16) | 0x6400
        y = bits.to(tl.float16, bitcast=True) - 1152.0
        return y.to(dtype)
    else:
        # Through fp32: int8 -> fp16 directly is a slow conversion on Hopper (the bf16 route,
        # which goes through fp32 anyway, measured up to 15 % faster); fp32 -> 16 bit is a fast
        # paired conversion.
        return w.to(tl.float32).to(dtype)


def _bench(fn, quantiles=None, **_):
    # The autotuner's timer, shorter than Triton's default (25 + 100 ms per config): a decode
    # matmul takes microseconds, so 20 ms is thousands of runs.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit(do_not_specialize=["split_k", "one_row"])
def _w8a16(
    x_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, split_k, one_row,
    BLOCK_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DOT: tl.constexpr, SWAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, MAGIC: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    # The config's words (tuning.py has the names): USE_DOT, the tensor-core loop, else the
    # one-row elementwise loop; SWAP, the weight tile as the dot's left operand (several rows);
    # PREFETCH ("pf1"), the one-row loop loads the next tile before it converts this one; MAGIC
    # ("magic0/1/2"), how int8 becomes float: 0 the conversion unit, 1 the fp16 bit trick in
    # Triton ops, 2 the same trick in packed PTX (`_to_compute`); split_k, programs along K.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    n_ok = offs_n[:, None] < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    cdt = x_ptr.dtype.element_ty
    tile = pid_m * tl.num_programs(0) + pid_n
    if USE_DOT and SWAP:
        # y^T = w @ x^T: the converted weight tile is the dot's left operand, which the tensor
        # cores take straight from registers (no shared-memory round trip of the converted
        # tile), and the rows of x are the narrow side (16 suffice for one row).
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m[None, :] < M
        xt_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # (BLOCK_K, BLOCK_M)
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k + tl.arange(0, BLOCK_K))[:, None] < k_hi
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok, other=0)
            else:
                kw_ok = (k + tl.arange(0, BLOCK_K))[None, :] < k_hi
                w = tl.load(w_ptrs, mask=n_ok & kw_ok, other=0)
            xt = tl.load(xt_ptrs, mask=m_ok & k_ok, other=0.0)
            acc_t = tl.dot(_to_compute(w, cdt, MAGIC), xt, acc_t)  # (BLOCK_N, BLOCK_M)
            xt_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        mask = (offs_n[:, None] < N) & m_ok
        n_idx = offs_n[:, None] + 0 * offs_m[None, :]
        _reduce_and_finish(
            acc_t, mask, n_idx, offs_m[None, :] * stride_ym + offs_n[:, None],
            offs_m[None, :] * stride_rm + offs_n[:, None], offs_m[None, :] * N + offs_n[:, None],
            tile, pid_k, split_k, M * N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            HAS_BIAS, ACT, HAS_RES,
        )  # fmt: skip
    elif USE_DOT:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m[:, None] < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):  # Triton's pipelining keeps loads ahead (stages)
            k_ok = (k + tl.arange(0, BLOCK_K))[None, :] < k_hi
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok, other=0)
            else:
                w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0)
            x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)  # (BLOCK_M, BLOCK_K)
            acc = tl.dot(x, tl.trans(_to_compute(w, cdt, MAGIC)), acc)  # (BLOCK_M, BLOCK_N)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        mask = m_ok & (offs_n[None, :] < N)
        n_idx = offs_n[None, :] + 0 * offs_m[:, None]
        _reduce_and_finish(
            acc, mask, n_idx, offs_m[:, None] * stride_ym + offs_n[None, :],
            offs_m[:, None] * stride_rm + offs_n[None, :], offs_m[:, None] * N + offs_n[None, :],
            tile, pid_k, split_k, M * N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            HAS_BIAS, ACT, HAS_RES,
        )  # fmt: skip
    else:  # one row
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PREFETCH:
            w_next = tl.load(w_ptrs, mask=n_ok & (offs_k[None, :] < k_hi), other=0)
        for k in range(k_lo, k_hi, BLOCK_K):
            kk = k + tl.arange(0, BLOCK_K)
            if PREFETCH:
                w = w_next
                nk_ok = (kk + BLOCK_K)[None, :] < k_hi
                w_next = tl.load(w_ptrs + BLOCK_K, mask=n_ok & nk_ok, other=0)
            else:
                w = tl.load(w_ptrs, mask=n_ok & (kk[None, :] < k_hi), other=0)
            x = tl.load(x_ptr + kk, mask=kk < k_hi, other=0.0).to(tl.float32)
            wf = _to_compute(w, tl.float32, MAGIC)
            acc2 += wf * x[None, :]
            w_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)  # (BLOCK_N,)
        mask = offs_n < N
        _reduce_and_finish(
            acc, mask, offs_n, offs_n, offs_n, offs_n,
            tile, pid_k, split_k, N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            HAS_BIAS, ACT, HAS_RES,
        )  # fmt: skip


# Launches the table has no config for: autotuned per (row bucket, N, K).
_w8a16_kernel = triton.autotune(
    configs=_configs(), key=["BLOCK_M", "one_row", "N", "K"], do_bench=_bench,
    prune_configs_by={"early_config_prune": _prune},
)(_w8a16)  # fmt: skip

_scratch: dict = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_scratch(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace fp32, tile counters int32) of this device, made once; the kernel leaves every
    counter at zero, so consecutive launches on a stream (and graph replays) share them."""
    key = _index(device)
    if key not in _scratch:
        _scratch[key] = (
            torch.empty(WORKSPACE_BYTES // 4, dtype=torch.float32, device=device),
            torch.zeros(COUNTERS, dtype=torch.int32, device=device),
        )
    return _scratch[key]


@functools.cache
def _table_config(device_index: int, dtype: str, M: int, N: int, K: int) -> str | None:
    """The tuned table's config for a launch (looked up once per launch shape, not per call)."""
    return tuning.lookup(torch.cuda.get_device_name(device_index), dtype, M, N, K)


def w8a16_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    config: str | None = None,
) -> torch.Tensor:
    """The fused W8A16 matmul with `config` (a tuning.py config name), else the tuned table's
    config for this GPU and shape, else the autotuner's (config="autotune": the autotuner's
    even where the table has the launch)."""
    M, K = x.shape
    N = q.shape[0]
    assert q.shape[1] == K and q.dtype == torch.int8 and q.is_contiguous()
    x = x.contiguous()
    if residual is not None:
        residual = residual.reshape(M, N)
        assert residual.stride(1) == 1
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m = max(16, tuning.row_bucket(M))  # the row tile of M's bucket
    m_tiles = triton.cdiv(M, block_m)
    ws, counters = _device_scratch(x.device)
    dtype = tuning.dtype_name(x.dtype)
    if config == "autotune":
        config = None
    elif config is None:
        config = _table_config(_index(x.device), dtype, M, N, K)
    elif why := tuning.illegal(config, M, N, K, dtype):
        raise ValueError(f"config {config!r} cannot run {M} x {K} by {N} ({dtype}): {why}")
    args = (
        x, q, scale, bias if bias is not None else scale,
        residual if residual is not None else y, y, ws, counters,
        M, N, K, x.stride(0), q.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0,
    )  # fmt: skip
    # The one-row loop (USE_DOT=0) is right for M == 1 only: one row is its own tuning key, apart
    # from 2..16 rows, so a config tuned for one row is never reused for more.
    flags = dict(one_row=int(M == 1), BLOCK_M=block_m, HAS_BIAS=bias is not None, ACT=gelu,
                 HAS_RES=residual is not None)  # fmt: skip

    def grid(meta):
        n_tiles = triton.cdiv(N, meta["BLOCK_N"])
        assert n_tiles * m_tiles <= COUNTERS, "more output tiles than split-K counters"
        assert meta["USE_DOT"] or M == 1, "the one-row loop picked for several rows"
        assert meta["split_k"] * M * N * 4 <= WORKSPACE_BYTES or meta["split_k"] == 1, (
            "split-K partials over the workspace"
        )
        return (n_tiles, meta["split_k"], m_tiles if meta["USE_DOT"] else 1)

    if config is None:
        _w8a16_kernel[grid](*args, **flags)
    else:
        kw, warps, stages = tuning.parse(config)
        _w8a16[grid(kw)](*args, **flags, **kw, num_warps=warps, num_stages=stages)
    return y
