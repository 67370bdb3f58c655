"""What every benchmark ends with: a markdown table, the JSON beside it, the machine it ran on;
and the GPU timers the benchmarks share."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table: the header cells, then one line per row of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save_result(result: dict, out: str, table: str) -> None:
    """The JSON at `out`, the markdown table beside it, the table on stdout."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(table + "\n")
    print(table)


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine()}  # fmt: skip
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_GB=p.total_memory / 1e9, sms=p.multi_processor_count)
    return info


def cuda_time(fn, *, iters: int, warmup: int = 3, median: bool = False) -> float:
    """Mean milliseconds of fn() over iters runs, timed with CUDA events; with `median`, each run
    timed alone and the median taken (few long runs, where one outlier would move a mean)."""
    for _ in range(warmup):
        fn()
    if median:
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_time_us(make_call, copies: int, calls: int = 24, reps: int = 10) -> float:
    """Microseconds per call of make_call(i) (i picks the weight copy), from a CUDA graph."""
    for i in range(copies):  # warm-up: autotuning and compilation happen outside the capture
        make_call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            make_call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def l2_copies(read_bytes: int, l2_bytes: int) -> int:
    """How many copies of what a call reads make a graph that cycles through them miss L2."""
    return max(2, -(-3 * l2_bytes // read_bytes))


def measure_ceilings() -> dict:
    """This GPU's device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate."""
    n = 1 << 30  # 1 GiB each way: far past the L2
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), iters=20)
    bw = 2 * n / (ms / 1e3)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = cuda_time(lambda: x @ y, iters=10)
    return {"copy_bandwidth_GBps": bw / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / (mm / 1e3) / 1e12}
