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
