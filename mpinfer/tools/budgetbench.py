"""`mpinfer bench budget`: the server under its memory budget and under sustained traffic, as a
client and nvidia-smi see it, in one run (bloom-7b1's shape, random weights).

Writes a random checkpoint, then serves it three ways, one after the other, each watched by a
thread that reads the serving processes' own GPU memory from NVML every 100 ms:

    24GiB     64 slots: the sustained mix on unique prompts at 32 and 64 closed-loop clients
              (each phase with its prefix-cache hit rate), the same with a shared 300-word
              system prompt (about 1,000 tokens), a burst of 32 x 128, greedy texts of 8 prompts
    24GiB-u32 the same server with the unique mix at 32 clients alone (an A/B's one phase)
    12GiB     64 clients on unique prompts, and the same greedy texts (a second start)
    6GiB      the model over its budget: the throughput plan (offloadplan.py: blocks in host
              memory, int8 KV, int8 embeddings, rows), 128 closed-loop clients of short
              prompts x 128 tokens, the greedy texts again
    6GiB-twin the same dtypes all on the GPU (24GiB, int8 KV and embeddings): greedy texts
              only, the resident server the offloaded one must equal (int8 embeddings round
              the logits differently from the 24GiB server's fp16 ones)
    int4      int4 weights at 24GiB, 64 slots: the unique mix at 32 and 64 clients, greedy
              texts twice (stable)

and reports each server's peak against its budget (the process's whole footprint: what a 24 GB
card would have to hold), tokens/s and latencies, whether the greedy texts of 24GiB and 12GiB
agree, and whether the offloaded server's equal its resident twin's. With --engine, the
engine's own step (no server) for the mix's ideal. What is not here: the served speed's other
phases (servegpu.py), the KV layouts (kvbench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch

from ..config import parse_bytes
from . import loadgen
from .randmodel import SHAPES
from .report import machine, md_table, save_result
from .serverproc import ServerProcess, load_phase
from .tiny import make_tiny

PROMPTS = [f"Prompt {i}: the river and the king of the city, then" for i in range(8)]


class ProcessMemory:
    """The GPU memory NVML counts for a process tree (a launcher and its ranks), every 100 ms."""

    def __init__(self, root_pid: int):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]  # fmt: skip
        self.root = psutil.Process(root_pid)
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def now(self) -> float:
        """MiB of the tree on every GPU (each rank on its own: their largest)."""
        pids = {self.root.pid, *(c.pid for c in self.root.children(recursive=True))}
        per_gpu = [sum(p.usedGpuMemory or 0
                       for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
                       if p.pid in pids) for h in self.handles]  # fmt: skip
        return max(per_gpu) / 2**20

    def _run(self):
        while not self.stop.wait(0.1):
            try:
                self.samples.append(self.now())
            except (psutil.Error, self.nvml.NVMLError):  # the server is going away
                return

    def close(self) -> dict:
        self.stop.set()
        self.thread.join(timeout=2)
        return {"peak_MiB": max(self.samples, default=None), "samples": len(self.samples),
                "last_MiB": self.samples[-1] if self.samples else None}  # fmt: skip


def greedy(url: str, n: int = 32) -> list[str]:
    out = []
    for p in PROMPTS:
        r = httpx.post(url + "/generate", json={"inputs": p, "parameters": {
            "max_new_tokens": n, "do_sample": False}}, timeout=300)  # fmt: skip
        out.append(r.json().get("generated_text", r.text))
    return out


def short_work(n: int = 100_000) -> list[tuple[str, int]]:
    """Short prompts (one 9-word sentence and a unique opening) x 128 tokens each."""
    return loadgen.mixed_requests(n, 3, repeats=(1,), outputs=(128, 128))


def serve(ckpt: Path, budget: str, phases, *settings: str, env: dict | None = None) -> dict:
    """One server under `budget`, its peak memory watched while `phases(url)` runs."""
    t0 = time.perf_counter()
    server = ServerProcess(1, str(ckpt), 'quant.method="int8"', *settings,
                           f'model.memory_budget="{budget}"', "server.max_queue=1024",
                           env=env)  # fmt: skip
    row = {"budget": budget, "start_s": time.perf_counter() - t0}
    mem = ProcessMemory(server.proc.pid)
    try:
        info = httpx.get(server.url + "/info", timeout=10).json()
        row.update(kv_blocks=info.get("kv_cache_blocks"), rows=info.get("max_batch_slots"),
                   at_ready_MiB=mem.now())  # fmt: skip
        row.update(phases(server.url))
    finally:
        row["memory"] = mem.close()
        row["exit_code"] = server.stop()
        log = server.output()
        row["preemptions"] = log.count("preempted (KV cache full)")
        row["log"] = [
            ln
            for ln in log.splitlines()
            if "preempted" not in ln
            and re.search(r"KV cache|warm-up|captured|throughput|host memory|copies at", ln)
        ][-12:]
        if plan := re.search(r"a step of (\d+) rows ([\d.]+) ms, (\d+) tok/s", log):
            row["plan"] = {"rows": int(plan[1]), "step_ms": float(plan[2]),
                           "tok_s": float(plan[3])}  # fmt: skip
        if floor := re.search(r"copies at ([\d.]+) GB/s: .* takes at least (\d+) ms", log):
            row["copy_GBps"], row["floor_ms"] = float(floor[1]), float(floor[2])
    limit = parse_mib(budget)
    row["peak_over_budget_MiB"] = (row["memory"]["peak_MiB"] or 0) - limit
    short = {k: v for k, v in row.items() if k not in ("phases", "greedy")}
    short["phases"] = {name: {k: v for k, v in p.items() if k != "first_error"}
                       for name, p in row.get("phases", {}).items()}  # fmt: skip
    print(json.dumps(short, default=str), flush=True)
    return row


def parse_mib(text: str) -> float:
    return parse_bytes(text, "budget") / 2**20


def run_budget(a) -> dict:
    shape = SHAPES[a.shape]
    ckpt = Path(a.workdir) / f"{a.shape}-random"
    if not (ckpt / "config.json").exists():
        make_tiny(ckpt, layers=shape.n_layer, hidden=shape.hidden_size, heads=shape.n_head,
                  vocab=shape.vocab_size, shards=8, dtype="float16", device="cuda")  # fmt: skip
        torch.cuda.empty_cache()
    common = ('model.dtype="float16"', "server.max_seq_len=2048")
    result = {"shape": a.shape, "machine": machine(), "seconds": a.seconds, "servers": {}}
    system = loadgen.system_prompt(300)  # about 1,000 tokens with bloom's 250k vocabulary

    def full(url):
        ph = {}
        for clients in (32, 64):
            ph[f"unique-{clients}"] = asyncio.run(loadgen.closed_loop(url, clients, a.seconds))
        shared = loadgen.mixed_requests(20_000, 5, system=system, repeats=(1, 4, 16))
        ph["shared-system-32"] = asyncio.run(loadgen.closed_loop(url, 32, a.seconds / 2,
                                                                 work=shared))  # fmt: skip
        ph["burst-32x128"] = asyncio.run(load_phase(url, 32, 128))
        return {"phases": ph, "greedy": greedy(url)}

    def half(url):
        ph = {"unique-64": asyncio.run(loadgen.closed_loop(url, 64, a.seconds / 2))}
        return {"phases": ph, "greedy": greedy(url)}

    def offload(url):  # a request lasts 128 steps of 100 ms or more: a longer phase
        ph = {"short-128": asyncio.run(loadgen.closed_loop(url, 128, a.offload_seconds,
                                                           work=short_work()))}  # fmt: skip
        return {"phases": ph, "greedy": greedy(url)}

    def unique32(url):  # the served A/B's one phase
        return {"phases": {"unique-32": asyncio.run(loadgen.closed_loop(url, 32, a.seconds))}}

    def twin(url):
        return {"phases": {}, "greedy": greedy(url)}

    def int4(url):
        ph = {f"unique-{c}": asyncio.run(loadgen.closed_loop(url, c, a.seconds / 2))
              for c in (32, 64)}  # fmt: skip
        first = greedy(url)
        return {"phases": ph, "greedy": first, "greedy_stable": first == greedy(url)}

    runs = {
        "24GiB": ("24GiB", full, "server.max_batch_slots=64"),
        "24GiB-u32": ("24GiB", unique32, "server.max_batch_slots=64"),
        "12GiB": ("12GiB", half, "server.max_batch_slots=64"),
        "6GiB": (a.offload_mem, offload),
        "6GiB-twin": ("24GiB", twin, 'quant.embeddings="int8"', 'server.kv_cache_dtype="int8"'),
        "int4": ("24GiB", int4, "server.max_batch_slots=64", 'quant.method="int4"'),
    }
    env = dict(kv.split("=", 1) for kv in a.env)
    for name in a.budgets:
        budget, fn, *extra = runs[name]
        try:
            result["servers"][name] = serve(ckpt, budget, fn, *common, *extra, *a.set, env=env)
        except Exception as e:  # one server failing must not lose the others' figures
            result["servers"][name] = {"budget": budget, "error": f"{type(e).__name__}: {e}"}
    result["greedy_equal"] = same_texts(result, "24GiB", "12GiB")
    result["offload_equal_twin"] = same_texts(result, "6GiB", "6GiB-twin")
    return result


def same_texts(result: dict, *names: str) -> list[bool]:
    """Per prompt, whether the named servers (those that ran) gave the same greedy text."""
    texts = [result["servers"][n]["greedy"] for n in names
             if "greedy" in result["servers"].get(n, {})]  # fmt: skip
    if len(texts) < 2:
        return []
    return [all(t[i] == texts[0][i] for t in texts) for i in range(len(PROMPTS))]


def budget_table(r: dict) -> str:
    rows, phase_rows = [], []
    for name, s in r["servers"].items():
        if "error" in s:
            rows.append([name, s["error"][:80], "", "", "", ""])
            continue
        m = s["memory"]
        rows.append([name, f"{parse_mib(s['budget']):,.0f}", f"{s['at_ready_MiB']:,.0f}",
                     f"{m['peak_MiB']:,.0f}", f"{s['peak_over_budget_MiB']:+,.0f}",
                     f"{s['kv_blocks']} blocks, {s['rows']} rows"
                     + (f", {s['preemptions']} preemptions" if s.get("preemptions") else "")
                     + (f"; copy floor {s['floor_ms']:.0f} ms a step at {s['copy_GBps']:.0f} GB/s"
                        if "floor_ms" in s else "")])  # fmt: skip
        for ph, p in s["phases"].items():
            if "mode" in p:
                phase_rows.append(loadgen.phase_row(f"{name} {ph}", p, None))
            else:
                phase_rows.append([f"{name} {ph}", f"{p['tok_per_s']:.0f}", "-", "-", "-",
                                   f"{p['ttft_ms_median']:.0f}", "-", "-",
                                   f"{p['itl_ms_median']:.1f}", "-", "-", "-", "-", "-",
                                   "-", p["errors"]])  # fmt: skip
    eq, off = r.get("greedy_equal", []), r.get("offload_equal_twin", [])
    return "\n".join([
        f"{r['machine'].get('gpu', 'cpu')}: {r['shape']} int8, random weights, `mpinfer serve "
        "--nproc 1`; the server's GPU memory as NVML counts it, every 100 ms", "",
        md_table(["budget", "budget MiB", "at ready MiB", "peak MiB", "peak - budget",
                  "KV cache"], rows), "",
        md_table(loadgen.PHASE_HEADER, phase_rows), "",
        f"greedy texts (8 prompts x 32 tokens), 24GiB and 12GiB equal: {sum(eq)} of {len(eq)}; "
        f"6GiB offloaded equal to its resident twin: {sum(off)} of {len(off)}",
    ])  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench budget", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="bloom-7b1", choices=list(SHAPES))
    p.add_argument("--budgets", default="24GiB,12GiB,6GiB,6GiB-twin,int4",
                   help="servers, in order (24GiB, 24GiB-u32, 12GiB, 6GiB, 6GiB-twin, "
                   "int4)")  # fmt: skip
    p.add_argument("--offload-mem", default="6GiB", help="the over-budget server's budget")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument(
        "--offload-seconds",
        type=float,
        default=60,
        help="the over-budget server's phase (its requests take 15 s or more each)",
    )
    p.add_argument("--workdir", default="/tmp/mpinfer-bench")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config setting for every server (repeatable)")  # fmt: skip
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for every server (repeatable)")  # fmt: skip
    p.add_argument("--out", default="bench/results/budget.json")
    a = p.parse_args(argv)
    for flag, items in (("--set", a.set), ("--env", a.env)):
        if bad := [kv for kv in items if "=" not in kv or kv.startswith("=")]:
            p.error(f"{flag} {bad[0]!r}: expected NAME=VALUE")
    if not torch.cuda.is_available():
        print("error: `mpinfer bench budget` needs a CUDA GPU")
        return 2
    a.budgets = a.budgets.split(",")
    result = run_budget(a)
    save_result(result, a.out, budget_table(result))
    return 0
