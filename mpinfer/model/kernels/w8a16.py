"""The W8A16 matmul, in Triton, for every row count a step has (1 to the step's token budget):

    y = act((x @ q^T) * scale + bias) + residual

    x (M, K) fp16/bf16    q (N, K) int8, row-major    scale (N,) fp32    y (M, N) x.dtype
    act: none or BLOOM's tanh GeLU          residual (M, N), optional

The int8 tile is loaded once per program and converted in registers; no path writes a
dequantized weight to memory. Decode reads every weight byte once and does almost no arithmetic
per byte, so at few rows the kernel's job is to keep enough loads in flight on every SM: split-K
cuts K into `split_k` runs, one program each, so small-N matrices still fill the GPU (the sum is
deterministic: launch.py). At many rows (a mixed step, a prefill) the tensor cores' work
outgrows the bytes, and programs own tiles of BLOCK_M rows; the row tiles of one weight tile run
side by side (launch.py's grid) and share it in L2.

Three inner loops; which one, with which tiles and split, is per (dtype, rows bucket, N, K): from
the GPU's tuned table or the default rule (tuning.py):
- USE_DOT: a BLOCK_N x BLOCK_K int8 tile is converted in registers and fed to the tensor cores
  (`tl.dot`, rows padded to 16 by masking). How int8 becomes float is the config's MAGIC
  (`_to_compute`): for fp16 the bit trick in packed PTX wins almost everywhere.
- USE_DOT and SWAP: the same, computing y^T = w @ x^T, so the converted weight tile is the left
  operand, which the tensor cores read from registers, in pairs of K positions (magic6 converts
  them as loaded: it won every 128-512-row launch of the H100's round-8 sweep).
- not USE_DOT (one row only): products accumulate elementwise in a BLOCK_N x BLOCK_K fp32 tile
  and are reduced across K once, after the loop (no cross-thread reduction per step); PREFETCH
  loads the next tile before it converts and multiplies this one (Triton does not pipeline it).
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from .launch import device_scratch, launch_plan, reduce_and_finish
from .w8a16_convert import _to_compute
from .w8a16_tma import try_tma, w8a16_tma_matmul


@triton.jit(do_not_specialize=["split_k"])
def _w8a16(
    x_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, split_k,
    BLOCK_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DOT: tl.constexpr, SWAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, MAGIC: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    # The config's words (tuning.py has the names): USE_DOT, the tensor-core loop, else the
    # one-row elementwise loop; SWAP, the weight tile as the dot's left operand (several rows);
    # PREFETCH ("pf1"), the one-row loop loads the next tile before it converts this one; MAGIC
    # ("magic0/1/2/6"), how int8 becomes float: 0 the conversion unit, 1 the fp16 bit trick in
    # Triton ops, 2 the same trick in packed PTX, four weights a call, 6 two a call
    # (`_to_compute`); split_k, programs along K;
    # BLOCK_M, the rows a program owns.
    pid_m = tl.program_id(0)  # row tiles fastest: they share each weight tile in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    n_ok = offs_n[:, None] < N
    # The tile's first row in 64 bits (N x K passes 2^31 for BLOOM-176B's int8 LM head at tp 1)
    w_tile = w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    w_ptrs = w_tile + tl.arange(0, BLOCK_N)[:, None] * stride_wn + offs_k[None, :]
    cdt = x_ptr.dtype.element_ty
    tile = pid_m * tl.num_programs(1) + pid_n
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
            if EVEN_K:  # every K tile is whole (splits are whole tiles): a row mask alone
                xt = tl.load(xt_ptrs, mask=m_ok, other=0.0)
            else:
                xt = tl.load(xt_ptrs, mask=m_ok & k_ok, other=0.0)
            acc_t = tl.dot(_to_compute(w, cdt, MAGIC), xt, acc_t)  # (BLOCK_N, BLOCK_M)
            xt_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        mask = (offs_n[:, None] < N) & m_ok
        n_idx = offs_n[:, None] + 0 * offs_m[None, :]
        reduce_and_finish(
            acc_t, mask, n_idx, offs_m[None, :] * stride_ym + offs_n[:, None],
            offs_m[None, :] * stride_rm + offs_n[:, None], offs_m[None, :] * N + offs_n[:, None],
            tile, pid_k, split_k, M * N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            True, HAS_BIAS, ACT, HAS_RES,
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
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok, other=0.0)  # (BLOCK_M, BLOCK_K)
            else:
                x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
            acc = tl.dot(x, tl.trans(_to_compute(w, cdt, MAGIC)), acc)  # (BLOCK_M, BLOCK_N)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        mask = m_ok & (offs_n[None, :] < N)
        n_idx = offs_n[None, :] + 0 * offs_m[:, None]
        reduce_and_finish(
            acc, mask, n_idx, offs_m[:, None] * stride_ym + offs_n[None, :],
            offs_m[:, None] * stride_rm + offs_n[None, :], offs_m[:, None] * N + offs_n[None, :],
            tile, pid_k, split_k, M * N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            True, HAS_BIAS, ACT, HAS_RES,
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
        reduce_and_finish(
            acc, mask, offs_n, offs_n, offs_n, offs_n,
            tile, pid_k, split_k, N, s_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr,
            True, HAS_BIAS, ACT, HAS_RES,
        )  # fmt: skip


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
    config for this GPU and shape, else the default rule's."""
    M, K = x.shape
    N = q.shape[0]
    assert q.shape[1] == K and q.dtype == torch.int8 and q.is_contiguous()
    x = x.contiguous()
    if residual is not None:
        residual = residual.reshape(M, N)
        assert residual.stride(1) == 1
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    kw, warps, stages, grid = launch_plan(x, N, K, config, bits=8)
    if kw.pop("TMA"):  # the warp-specialized loop (w8a16_tma.py)
        done = try_tma(partial(w8a16_tma_matmul, x, q, scale, bias, gelu, residual, y, kw, stages,
                               grid), x, kw, stages, config)  # fmt: skip
        if done is not None:
            return done
        warps = 8  # the same tile in the pointer-loaded swap loop (kw's SWAP is set)
    ws, counters = device_scratch(x.device)
    _w8a16[grid](
        x, q, scale, bias if bias is not None else scale,
        residual if residual is not None else y, y, ws, counters,
        M, N, K, x.stride(0), q.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0, kw["split_k"],
        HAS_BIAS=bias is not None, ACT=gelu, HAS_RES=residual is not None,
        EVEN_K=K % kw["BLOCK_K"] == 0, **{k: v for k, v in kw.items() if k != "split_k"},
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
