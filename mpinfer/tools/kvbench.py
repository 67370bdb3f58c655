"""`mpinfer bench kv`: what the KV cache's layout gives a served model under one memory budget,
side by side in one run.

Writes a random checkpoint of a real shape (default bloom-7b1; `tiny` on a CPU) and serves it
under `--gpu-mem` (default 24GiB, a consumer card) four times: the static layout (one
max_seq_len block per sequence), blocks of 16 tokens with the prefix cache, the same without it,
and blocks with an int8 cache. Each gets the same sustained mixed load (loadgen.py: closed-loop
clients, no two prompts sharing a prefix) and reports tokens/s, latencies, the cache's blocks
and the preemptions the server counted. On the blocks server, the prefix cache's own case:
a 1,024-token prompt whose first 1,000 tokens an earlier request already sent, against one
whose prefix is new (its cache cold). What is not here: the engine alone (gpubench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import httpx
import torch

from ..extras import require
from . import loadgen
from .randmodel import SHAPES
from .report import machine, md_table, save_result
from .serverproc import ServerProcess
from .tiny import make_tiny

LAYOUTS = {  # name: settings
    "static": ("server.kv_block_size=2048",),  # one max_seq_len block per sequence
    "blocks": (),  # blocks of 16, the prefix cache on (the defaults)
    "blocks-noprefix": ("server.prefix_caching=false",),
    "blocks-int8kv": ('server.kv_cache_dtype="int8"',),
}


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("mpinfer_") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def process_gpu_gib(pid: int) -> float | None:
    """GPU memory the driver counts for one process (NVML), the server's own footprint."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid:
                return p.usedGpuMemory / 2**30
    except Exception:  # no NVML, or a container that hides other pids: not measured
        return None
    return None


async def ttft(url: str, ids: list[int]) -> float:
    """Milliseconds to the first streamed token of a prompt of token ids."""
    aiohttp = require("aiohttp")
    async with aiohttp.ClientSession() as session:
        r = await loadgen.one_request(session, url, ids, 1)
    if "error" in r:
        raise RuntimeError(r["error"])
    return (r["times"][0] - r["start"]) * 1e3


def prefix_case(url: str, vocab: int, *, trials: int = 5, shared: int = 1000,
                total: int = 1024) -> dict:  # fmt: skip
    """TTFT of `total`-token prompts: a new prefix each time (cold), then the same first
    `shared` tokens with a different rest (warm: the prefix cache holds them)."""
    rng = random.Random(4)
    cold, warm = [], []
    for _ in range(trials):
        base = [rng.randrange(10, vocab) for _ in range(shared)]
        cold.append(asyncio.run(ttft(url, base + [rng.randrange(10, vocab) for _ in
                                                  range(total - shared)])))  # fmt: skip
        warm.append(asyncio.run(ttft(url, base + [rng.randrange(10, vocab) for _ in
                                                  range(total - shared)])))  # fmt: skip
    return {"cold_ms": statistics.median(cold), "warm_ms": statistics.median(warm),
            "warm_over_cold": statistics.median(warm) / statistics.median(cold),
            "trials": trials}  # fmt: skip


def run_kv(a) -> dict:
    gpu = torch.cuda.is_available()
    shape = a.shape or ("bloom-7b1" if gpu else "tiny")
    ckpt = Path(a.workdir) / f"{shape}-random"
    if not (ckpt / "config.json").exists():
        if shape == "tiny":
            make_tiny(ckpt)
        else:
            s = SHAPES[shape]
            make_tiny(ckpt, layers=s.n_layer, hidden=s.hidden_size, heads=s.n_head,
                      vocab=s.vocab_size, shards=8, dtype="float16", device="cuda")  # fmt: skip
            torch.cuda.empty_cache()  # what this process keeps is not the server's
    base = ('quant.method="int8"', "server.max_batch_slots=64", "server.max_seq_len=2048",
            "server.max_queue=1024")  # fmt: skip
    if gpu:
        base += ('model.dtype="float16"', f'model.memory_budget="{a.gpu_mem}"')
    else:  # a CPU has no budget to fill: a cache of 16 max_seq_len sequences' tokens
        base += ("server.kv_cache_tokens=32768",)
    result = {"shape": shape, "machine": machine(), "budget": a.gpu_mem if gpu else None,
              "clients": a.clients, "seconds": a.seconds, "layouts": {}}  # fmt: skip
    for name in a.layouts:
        t0 = time.perf_counter()
        server = ServerProcess(1, str(ckpt), *base, *LAYOUTS[name])
        row = {"start_s": time.perf_counter() - t0}
        try:
            info = httpx.get(server.url + "/info", timeout=10).json()
            row.update(kv_blocks=info["kv_cache_blocks"], block_size=info["kv_block_size"],
                       rows=info["max_batch_slots"])  # fmt: skip
            if name == "blocks":
                row["prefix"] = prefix_case(server.url, 1000 if shape == "tiny" else 250000)
            before = metrics(server.url)
            row["load"] = asyncio.run(loadgen.closed_loop(server.url, a.clients, a.seconds))
            row["server_gpu_gib"] = process_gpu_gib(server.rank0_pid()) if gpu else None
            after = metrics(server.url)
            row["preemptions"] = after["mpinfer_preemptions_total"] - before.get(
                "mpinfer_preemptions_total", 0
            )
            row["prefix_hit_tokens"] = after["mpinfer_prefix_cache_hit_tokens_total"] - before.get(
                "mpinfer_prefix_cache_hit_tokens_total", 0
            )
        finally:
            row["exit_code"] = server.stop()
            row["log_tail"] = server.output()[-1500:]
        result["layouts"][name] = row
        print(name, {k: v for k, v in row.items() if k != "log_tail"}, flush=True)
    return result


def kv_table(r: dict) -> str:
    header = ["layout", "KV blocks x tokens", "sequences", "output tok/s", "TTFT p50 ms",
              "ITL p50 ms", "ITL p99 ms", "preemptions", "server GPU GiB", "errors"]  # fmt: skip
    rows = []
    for name, row in r["layouts"].items():
        p = row["load"]
        rows.append([name, f"{row['kv_blocks']} x {row['block_size']}", row["rows"],
                     f"{p['tok_per_s']:.0f}", f"{p['ttft_ms_p50']:.0f}", f"{p['itl_ms_p50']:.1f}",
                     f"{p['itl_ms_p99']:.1f}", f"{row['preemptions']:.0f}",
                     "-" if row.get("server_gpu_gib") is None else f"{row['server_gpu_gib']:.1f}",
                     p["errors"]])  # fmt: skip
    lines = [f"{r['machine'].get('gpu', 'cpu')}: {r['shape']} int8, budget {r['budget']}, "
             f"{r['clients']} closed-loop clients for {r['seconds']} s each", "",
             md_table(header, rows)]  # fmt: skip
    p = r["layouts"].get("blocks", {}).get("prefix")
    if p:
        lines += ["", f"prefix cache, 1,024-token prompt sharing its first 1,000 tokens: TTFT "
                  f"{p['warm_ms']:.1f} ms against {p['cold_ms']:.1f} ms with the prefix new "
                  f"({p['warm_over_cold']:.2f} x, median of {p['trials']})"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench kv", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=[*SHAPES, "tiny"], help="default bloom-7b1 (CPU: tiny)")
    p.add_argument("--gpu-mem", default="24GiB", help="the server's GPU budget")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {list(LAYOUTS)}")
    p.add_argument("--workdir", default="/tmp/mpinfer-bench")
    p.add_argument("--out", default="bench/results/kv.json")
    a = p.parse_args(argv)
    a.layouts = a.layouts.split(",")
    result = run_kv(a)
    save_result(result, a.out, kv_table(result))
    return 0
