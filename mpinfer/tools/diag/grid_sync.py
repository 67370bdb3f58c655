"""What a persistent kernel could save per matmul boundary: two reads of B bytes each (standing
for two consecutive weight matrices) as two launches, against one launch whose programs meet at
a grid-wide barrier between them (an atomic counter; every program resident: a few per SM),
with and without each program requesting its first lines of the second read before it waits,
and against one launch reading 2 B with no barrier (the ideal). CUDA graphs, reads from HBM.
python3 -m mpinfer.tools.diag.grid_sync"""

import torch
import triton
import triton.language as tl

from .common import graph_us, read_chunks


@triton.jit
def _chunk_sum(base, chunk, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, chunk, 2 * BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK)).to(tl.int32)
        acc += tl.load(base + start + BLOCK + tl.arange(0, BLOCK)).to(tl.int32)
    return tl.sum(acc, axis=0)


@triton.jit
def _read_sync_read(x_ptr, y_ptr, out_ptr, cnt_ptr, chunk, BLOCK: tl.constexpr,
                    EARLY: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    s = _chunk_sum(x_ptr + pid.to(tl.int64) * chunk, chunk, BLOCK)
    ybase = y_ptr + pid.to(tl.int64) * chunk
    if EARLY:  # the second read's first lines, requested before the barrier
        first = tl.load(ybase + tl.arange(0, BLOCK)).to(tl.int32)
    arrived = tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu") + 1
    while arrived < P:  # the barrier: wait until every program has finished its first read
        arrived = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    s += _chunk_sum(ybase, chunk, BLOCK)
    if EARLY:
        s += tl.sum(first, axis=0)
    tl.store(out_ptr + pid, s)


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pool = torch.randint(-127, 128, (2 << 30,), dtype=torch.int8, device="cuda")
    out = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    BLOCK, PER_SM, WARPS = 2048, 4, 4
    P = sms * PER_SM
    print(f"{torch.cuda.get_device_name()}: {P} programs ({PER_SM} per SM), {WARPS} warps\n")
    print(
        "| bytes each | two launches us | one launch, barrier | + early request | one read of 2x |"
    )
    print("|---|---|---|---|---|")
    for size in (16 << 20, 32 << 20, 64 << 20, 128 << 20):
        chunk = size // P // (2 * BLOCK) * (2 * BLOCK)
        pairs = min(16, (2 << 30) // (2 * size))
        bufs = [(pool[2 * i * size :], pool[(2 * i + 1) * size :]) for i in range(pairs)]
        cnt = torch.zeros(pairs, dtype=torch.int32, device="cuda")

        def two(bufs=bufs, chunk=chunk):
            for x, y in bufs:
                read_chunks[(P,)](x, out, chunk, BLOCK=BLOCK, UNROLL=2, num_warps=WARPS)
                read_chunks[(P,)](y, out, chunk, BLOCK=BLOCK, UNROLL=2, num_warps=WARPS)

        def fused(early, bufs=bufs, chunk=chunk, cnt=cnt):
            cnt.zero_()
            for i, (x, y) in enumerate(bufs):
                _read_sync_read[(P,)](x, y, out, cnt[i:], chunk, BLOCK=BLOCK, EARLY=early,
                                      num_warps=WARPS)  # fmt: skip

        def double(bufs=bufs, chunk=chunk):
            for x, _ in bufs:
                read_chunks[(P,)](x, out, 2 * chunk, BLOCK=BLOCK, UNROLL=2, num_warps=WARPS)

        t = [
            graph_us([two]) / pairs,
            graph_us([lambda: fused(0)]) / pairs,
            graph_us([lambda: fused(1)]) / pairs,
            graph_us([double]) / pairs,
        ]
        print(f"| {size >> 20} MiB | " + " | ".join(f"{v:.1f}" for v in t) + " |", flush=True)


if __name__ == "__main__":
    main()
