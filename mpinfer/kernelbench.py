"""`mpinfer bench kernels`: the decode matmul alone, per weight shape of bloom-7b1 and of one
BLOOM-176B tp-8 rank, at 1, 8 and 32 rows: mpinfer's W8A16 kernel against cuBLAS fp16 on the
same shape, and both against the device-to-device copy bandwidth measured in the same run.

Each kernel is timed inside a CUDA graph (launch overhead would otherwise dominate a 5 us
kernel) that cycles through enough copies of the weight to overflow the L2 cache, so every call
reads its weight from HBM as in a real decode step. The autotuner's pick and its timing of every
candidate config go to the JSON (what the config list in kernels/w8a16.py is chosen from).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

# name: (N = out features, K = in features, fused epilogue as in the model)
SHAPES = {
    "7b1 qkv": (12288, 4096, ""),
    "7b1 dense": (4096, 4096, "residual"),
    "7b1 fc1": (16384, 4096, "gelu"),
    "7b1 fc2": (4096, 16384, "residual"),
    "7b1 lm_head": (250880, 4096, ""),
    "176b/8 qkv": (5376, 14336, ""),
    "176b/8 dense": (14336, 1792, "residual"),
    "176b/8 fc1": (7168, 14336, "gelu"),
    "176b/8 fc2": (14336, 7168, "residual"),
    "176b/8 lm_head": (31360, 14336, ""),
}


def graph_time_us(make_call, copies: int, calls: int = 24) -> float:
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
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def config_text(cfg) -> str:
    kw = cfg.kwargs
    kind = ("swap" if kw.get("SWAP") else "dot") if kw.get("USE_DOT") else "fma"
    return (f"{kind} n{kw['BLOCK_N']} k{kw['BLOCK_K']} split{kw['split_k']} pf{kw['PREFETCH']} "
            f"magic{kw.get('MAGIC', 0)} w{cfg.num_warps} s{cfg.num_stages}")  # fmt: skip


def bench_shape(name, N, K, epilogue, M, dtype, l2_bytes) -> dict:
    from .kernels import w8a16

    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    w_bytes = N * K
    copies = max(2, -(-3 * l2_bytes // w_bytes))
    qs = [torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda", generator=g)
          for _ in range(copies)]  # fmt: skip
    scale = torch.rand(N, device="cuda", generator=g) / 1000
    x = torch.randn(M, K, device="cuda", generator=g, dtype=dtype)
    bias = None if name.endswith("lm_head") else torch.randn(N, device="cuda", dtype=dtype)
    res = torch.randn(M, N, device="cuda", dtype=dtype) if epilogue == "residual" else None
    gelu = epilogue == "gelu"

    def ours(i):
        return w8a16.w8a16_matmul(x, qs[i], scale, bias, gelu=gelu, residual=res)

    ours(0)  # autotune
    tuner = w8a16._w8a16_kernel
    timings = sorted(
        ((config_text(c), t[0] if isinstance(t, list) else t)
         for c, t in getattr(tuner, "configs_timings", {}).items()),
        key=lambda ct: ct[1],
    )  # fmt: skip
    best = config_text(tuner.best_config)
    us = graph_time_us(ours, copies)
    qs.clear()  # free the int8 copies before the fp16 ones
    ws = [torch.randn(N, K, device="cuda", generator=g, dtype=dtype) for _ in range(
        max(2, -(-3 * l2_bytes // (2 * w_bytes))))]  # fmt: skip

    def cublas(i):
        y = F.linear(x, ws[i], bias)
        if gelu:
            y = F.gelu(y, approximate="tanh")
        return y + res if res is not None else y

    us16 = graph_time_us(cublas, len(ws))
    ws.clear()
    torch.cuda.empty_cache()
    return {
        "shape": name, "N": N, "K": K, "M": M, "dtype": str(dtype).split(".")[-1],
        "epilogue": epilogue or "bias",
        "int8_us": us, "int8_GBps": (w_bytes + 4 * N) / us / 1e3,
        "fp16_us": us16, "fp16_GBps": 2 * w_bytes / us16 / 1e3,
        "config": best, "autotune_ms": timings,
    }  # fmt: skip


def markdown(result: dict) -> str:
    from .bench import md_table

    bw = result["copy_bandwidth_GBps"]
    header = ["shape", "N x K", "rows", "dtype", "int8 us", "int8 GB/s", "% of copy", "fp16 us",
              "fp16 GB/s", "int8 speed-up", "config"]  # fmt: skip
    rows = [[r["shape"], f"{r['N']} x {r['K']}", r["M"], r["dtype"], f"{r['int8_us']:.1f}",
             f"{r['int8_GBps']:.0f}", f"{100 * r['int8_GBps'] / bw:.0f}", f"{r['fp16_us']:.1f}",
             f"{r['fp16_GBps']:.0f}", f"{r['fp16_us'] / r['int8_us']:.2f}", r["config"]]
            for r in result["rows"]]  # fmt: skip
    return (
        f"{result['gpu']}: copy {bw / 1e3:.2f} TB/s. W8A16 decode matmul (fused epilogue) vs "
        "cuBLAS fp16 (+ separate epilogue ops), each in a CUDA graph, weights from HBM\n\n"
        + md_table(header, rows)
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["kernels"])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--bf16-rows", default="1", help="rows also measured in bf16 ('' for none)")
    p.add_argument("--out", default="bench/results/kernels.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: `mpinfer bench kernels` needs a CUDA GPU")
        return 2
    from .bench import machine, measure_ceilings, save_result

    ceil = measure_ceilings()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 64 << 20)
    rows = []
    runs = [(int(m), torch.float16) for m in a.rows.split(",") if m]
    runs += [(int(m), torch.bfloat16) for m in a.bf16_rows.split(",") if m]
    for name in a.shapes.split(","):
        N, K, epi = SHAPES[name]
        for M, dtype in runs:
            r = bench_shape(name, N, K, epi, M, dtype, l2)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "autotune_ms"}), flush=True)
    result = {"machine": machine(), "gpu": props.name, **ceil, "rows": rows}
    save_result(result, a.out, markdown(result))
    return 0
