"""int8 rows -> compute dtype, w = q * scale[:, None], in one pass (the prefill path).

torch's broadcasting `q * scale[:, None]` moved about 1 TB/s on the H200 (19 ms of a 72 ms
2048-token bloom-7b1 prefill); this kernel reads 1 byte and writes 2 per weight in 2D tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, w_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    idx = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    q = tl.load(q_ptr + idx, mask=ok, other=0).to(tl.float32)
    s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    tl.store(w_ptr + idx, (q * s[:, None]).to(w_ptr.dtype.element_ty), mask=ok)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, K = q.shape
    w = torch.empty((N, K), dtype=dtype, device=q.device)
    grid = (triton.cdiv(N, 16), triton.cdiv(K, 512))
    _dequant_kernel[grid](q, scale, w, N, K, BLOCK_N=16, BLOCK_K=512, num_warps=4)
    return w
