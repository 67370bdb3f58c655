"""What the diag scripts share: a CUDA-graph timer and a plain read-only kernel."""

import torch
import triton
import triton.language as tl


@triton.jit
def read_chunks(x_ptr, out_ptr, chunk, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Program p sums the int8 bytes x[p chunk : (p + 1) chunk], UNROLL loads of BLOCK bytes in
    flight at a time (chunk a multiple of BLOCK x UNROLL)."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * chunk
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, chunk, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            acc += tl.load(base + start + u * BLOCK + tl.arange(0, BLOCK)).to(tl.int32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def graph_us(calls, reps: int = 5) -> float:
    """Best microseconds per call of a CUDA graph that runs `calls` (callables) in order, once
    each; they run once before the capture (compilation, autotuning)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / len(calls))
    return best


@triton.jit
def read_tiles(w_ptr, out_ptr, K, split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Programs own BLOCK_N rows (K bytes apart) and a split's run of K, and step through it
    BLOCK_K bytes of each row at a time, as the weight-only matmuls walk their weights: the
    bytes summed, no other arithmetic."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), split) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + k_lo + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for _ in range(k_lo, k_hi, BLOCK_K):
        acc += tl.load(ptrs).to(tl.int32)
        ptrs += BLOCK_K
    tl.store(out_ptr + pid_n * split + pid_k, tl.sum(tl.sum(acc, axis=1), axis=0))
