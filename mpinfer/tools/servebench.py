"""The engine and the server under load, measured the way a user measures them.

    mpinfer bench engine        (CPU) tokens/s of the engine against the number of concurrent
                                requests (1..16), against the same requests one after another
    mpinfer bench serve         (CPU) the real server (`mpinfer serve --nproc 2`, the mid model)
                                on 127.0.0.1: requests/s, p50/p99 latency and time to first
                                token at 1, 8 and 32 concurrent streaming clients
    mpinfer bench serve --gpu   the served speed on a GPU: writes a random checkpoint of a real
                                shape (default bloom-7b1), starts `mpinfer serve --nproc 1`,
                                measures through HTTP with streaming clients (one client's
                                inter-token gap over 256 tokens; 1, 8, 32 and 64 concurrent
                                requests of 128 tokens: tokens/s and time to first token), then,
                                in the same run, the engine's own decode step without the server
                                (the runner's graph replay) and transformers fp16 `generate` at
                                batch 32 on the same checkpoint; `--profile` records the serving
                                rank with py-spy during the 1- and 32-client phases

Each prints a markdown table and writes JSON (and the table) under bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch

from ..config import load_config
from ..dist import init_distributed, teardown
from ..engine import Engine
from ..extras import require
from ..launcher import free_port
from ..loader import load_model
from ..runner import ModelRunner, Prefill, Step
from ..runtime import load_tokenizer
from ..sampling import Row, Sampler, SamplingParams
from . import loadgen
from .randmodel import SHAPES, decode_step, fill_context
from .report import cuda_time, machine, md_table, save_result
from .tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# -- the engine alone (CPU) ----------------------------------------------------------------------
def run_engine(a) -> dict:
    ctx = init_distributed()
    models = {
        "tiny (2x64, 0.2M params)": dict(layers=2, hidden=64, heads=4, vocab=1024),
        "mid (8x512, 29M params)": dict(layers=8, hidden=512, heads=8, vocab=8192),
    }
    rows = []
    for name, kw in models.items():
        path = Path(a.workdir) / ("engine-" + name.split()[0])
        if not (path / "config.json").exists():
            make_tiny(path, **kw)
        cfg = load_config(None, [f'model.path="{path}"'])
        loaded = load_model(cfg, ctx)
        runner = ModelRunner(loaded, ctx, slots=16, max_seq=128)
        tok = load_tokenizer(str(path))
        params = SamplingParams(max_new_tokens=32)
        prompts = [tok.encode(f"request {i} about the river and the king",
                              add_special_tokens=False).ids for i in range(16)]  # fmt: skip
        for n in (1, 2, 4, 8, 16):
            engine = Engine(runner, ctx, tok)
            t0 = time.perf_counter()
            for p in prompts[:n]:
                engine.submit(p, params, lambda ev: None)
            engine.run(until_idle=True)
            together = engine.generated_tokens / (time.perf_counter() - t0)
            t0, total = time.perf_counter(), 0
            for p in prompts[:n]:
                engine = Engine(runner, ctx, tok)
                engine.submit(p, params, lambda ev: None)
                engine.run(until_idle=True)
                total += engine.generated_tokens
            alone = total / (time.perf_counter() - t0)
            row = {"model": name, "concurrent": n, "batched_tok_s": together,
                   "sequential_tok_s": alone}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    teardown()
    return {"rows": rows, "tp": 1, "max_new_tokens": 32}


def engine_table(result: dict) -> str:
    header = ["model", "concurrent requests", "batched tokens/s", "one after another tokens/s",
              "speed-up"]  # fmt: skip
    return md_table(header, [
        [r["model"], r["concurrent"], f"{r['batched_tok_s']:.0f}", f"{r['sequential_tok_s']:.0f}",
         f"{r['batched_tok_s'] / r['sequential_tok_s']:.2f}x"]
        for r in result["rows"]
    ])  # fmt: skip


# -- a real server -------------------------------------------------------------------------------
def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll `url`/health until it answers 200 (True), the launcher exits or `timeout` passes
    (False). Refused connections and 503s are what a loading server gives."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):  # not listening yet
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        time.sleep(0.2)
    return False


class ServerProcess:
    """`mpinfer serve --nproc N ...` on 127.0.0.1, ready when /health says so."""

    def __init__(self, nproc: int, model: str, *settings: str, timeout: float = 900,
                 env: dict | None = None):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "mpinfer.cli",
            "serve",
            "--nproc",
            str(nproc),
            "--model",
            model,
            "--port",
            str(self.port),
            *[x for s in settings for x in ("--set", s)],
        ]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**ENV, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        if not wait_ready(self.url, self.proc, timeout):
            self.stop()
            raise RuntimeError("the server did not start:\n" + self.output()[-3000:])

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def rank0_pid(self) -> int:
        return psutil.Process(self.proc.pid).children()[0].pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)  # the second signal: at once
                self.proc.wait(timeout=30)
        return self.proc.returncode


async def stream_one(session, url: str, prompt: str, max_new: int) -> dict:
    """One streaming /generate_stream request: the arrival time of every token event."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new}}
    t0 = time.perf_counter()
    times = []
    async with session.post(url + "/generate_stream", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {await r.text()}"}
        async for line in r.content:
            if line.startswith(b"data:"):
                times.append(time.perf_counter())
                if b'"error"' in line[:20]:
                    return {"error": line.decode()}
    return {"start": t0, "times": times}


async def load_phase(url: str, clients: int, max_new: int) -> dict:
    """`clients` concurrent requests of `max_new` tokens: tokens/s over the phase, TTFT."""
    aiohttp = require("aiohttp")
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            stream_one(session, url, f"Request {i} about the river and the king of the city",
                       max_new)
            for i in range(clients)
        ])  # fmt: skip
        wall = time.perf_counter() - t0
    ok = [r for r in results if "times" in r]
    tokens = sum(len(r["times"]) for r in ok)
    ttft = sorted((r["times"][0] - r["start"]) * 1e3 for r in ok if r["times"])
    gaps = [(b - a) * 1e3 for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {
        "clients": clients,
        "max_new_tokens": max_new,
        "errors": len(results) - len(ok),
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "ttft_ms_median": statistics.median(ttft) if ttft else None,
        "ttft_ms_max": max(ttft) if ttft else None,
        "itl_ms_median": statistics.median(gaps) if gaps else None,
        "itl_ms_p90": statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 10 else None,
    }


def run_serve(a) -> dict:
    """CPU: the mid model on 2 ranks, streaming clients looping for a fixed time."""
    path = Path(a.workdir) / "serve-mid"
    if not (path / "config.json").exists():
        make_tiny(path, layers=8, hidden=512, heads=8, vocab=8192)
    server = ServerProcess(2, str(path), "server.max_batch_slots=32", "server.max_seq_len=256")
    rows = []
    try:
        for clients in (1, 8, 32):
            lat, ttft, errors = [], [], 0
            stop_at = time.time() + a.seconds

            def client(i):
                nonlocal errors
                n = 0
                while time.time() < stop_at and n < 1000:
                    n += 1
                    body = {"inputs": f"client {i} asks about the river {n}",
                            "parameters": {"max_new_tokens": 16}}  # fmt: skip
                    t0, first = time.perf_counter(), None
                    try:
                        with httpx.stream("POST", server.url + "/generate_stream", json=body,
                                          timeout=60) as r:  # fmt: skip
                            for line in r.iter_lines():
                                if line.startswith("data:") and first is None:
                                    first = time.perf_counter() - t0
                        lat.append(time.perf_counter() - t0)
                        ttft.append(first)
                    except httpx.HTTPError:
                        errors += 1

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            lat.sort()
            ttft.sort()

            def pct(xs, q):
                return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")

            row = {"clients": clients, "requests": len(lat), "errors": errors,
                   "req_s": len(lat) / wall, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
                   "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    return {"rows": rows, "model": "mid (8x512, 29M params)", "tp": 2, "max_new_tokens": 16}


def serve_table(result: dict) -> str:
    header = ["clients", "requests", "errors", "requests/s", "p50 ms", "p99 ms", "TTFT p50 ms",
              "TTFT p99 ms"]  # fmt: skip
    return md_table(header, [
        [r["clients"], r["requests"], r["errors"], f"{r['req_s']:.1f}", f"{r['p50_ms']:.0f}",
         f"{r['p99_ms']:.0f}", f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}"]
        for r in result["rows"]
    ])  # fmt: skip


# -- the served speed on a GPU -------------------------------------------------------------------
def profile(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    """py-spy recording the serving rank (raw collapsed stacks), if py-spy is installed."""
    try:
        return subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)),
                                 "-r", "200", "-f", "raw", "-o", str(out), "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    except FileNotFoundError:
        return None


def top_frames(raw: Path, n: int = 30) -> dict:
    """From py-spy's raw output: the frames holding the most samples, with what is below them
    (inclusive %) and on their own (self %), per thread."""
    if not raw.exists():
        return {}
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    all_samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        c = int(count)
        all_samples += c
        frames = stack.split(";")
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + c
        own[frames[-1]] = own.get(frames[-1], 0) + c
    pct = lambda d: [(f, round(100 * c / max(all_samples, 1), 1))  # noqa: E731
                     for f, c in sorted(d.items(), key=lambda kv: -kv[1])[:n]]  # fmt: skip
    return {"samples": all_samples, "inclusive": pct(inclusive), "self": pct(own)}


def engine_steps(ckpt: str, batches: list[int], context: int) -> dict:
    """In this process: the checkpoint as the server loads it, the runner's decode step (graph
    replay) at each batch size, and the same step with the sampler (greedy)."""
    ctx = init_distributed()
    cfg = load_config(None, [f'model.path="{ckpt}"', 'quant.method="int8"',
                             'model.dtype="float16"'])  # fmt: skip
    loaded = load_model(cfg, ctx)
    runner = ModelRunner(loaded, ctx, slots=max(batches), max_seq=max(context + 64, 2048 + 64))
    out_prefill = {}
    for T in (512, 2048):  # one prompt's prefill: T tokens in one step (512 graphed, 2048 eager)
        tokens = tuple(range(4, 4 + T))
        step = Step(prefills=(Prefill(0, 0, tokens, sample=True),))
        out_prefill[T] = T / (cuda_time(lambda: runner.execute(step), iters=5) / 1e3)
    fill_context(runner, max(batches), context)
    sampler = Sampler(slots=runner.slots, vocab_size=loaded.shape.vocab_size, eos_token_id=2,
                      device=runner.device)  # fmt: skip
    out = {"step_ms": {}, "step_with_sampling_ms": {}, "graph_capture_s": runner.capture_seconds,
           "graph_MiB": runner.capture_bytes / 2**20, "warm_up_s": runner.warm_up_seconds,
           "prefill_tok_s": out_prefill}  # fmt: skip
    greedy = SamplingParams(max_new_tokens=1)
    for B in batches:
        step = decode_step(B, context)
        out["step_ms"][B] = cuda_time(lambda: runner.execute(step), iters=50)
        rows = [Row(i, greedy, 1) for i in range(B)]

        def sampled():
            slots, tokens, _ = sampler.sample(runner.execute(step), rows)
            runner.set_next_tokens(slots, tokens)

        out["step_with_sampling_ms"][B] = cuda_time(sampled, iters=50)
    runner = sampler = loaded = None  # free the GPU for the transformers baseline
    teardown()
    torch.cuda.empty_cache()
    return out


def transformers_generate(ckpt: str, batch: int, max_new: int) -> dict:
    transformers = require("transformers")
    model = transformers.BloomForCausalLM.from_pretrained(ckpt, dtype=torch.float16).cuda().eval()
    prompt = load_tokenizer(ckpt).encode("Request about the river and the king of the city",
                                         add_special_tokens=False).ids  # fmt: skip
    ids = torch.tensor([prompt] * batch, device="cuda")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=3)
    model.generate(**inputs, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(**inputs, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * batch
    del model
    torch.cuda.empty_cache()
    return {"batch": batch, "max_new_tokens": max_new, "tokens": tokens, "wall_s": wall,
            "tok_per_s": tokens / wall}  # fmt: skip


def run_serve_gpu(a) -> dict:
    shape = SHAPES[a.shape]
    ckpt = Path(a.workdir) / f"{a.shape}-random"
    t0 = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_tiny(ckpt, layers=shape.n_layer, hidden=shape.hidden_size, heads=shape.n_head,
                  vocab=shape.vocab_size, shards=8, dtype="float16", device="cuda")  # fmt: skip
    result = {"shape": a.shape, "checkpoint_write_s": time.perf_counter() - t0,
              "machine": machine(), "phases": {}}  # fmt: skip
    spy_dir = Path(a.workdir)
    # A compile cache of its own, empty: the start and the first burst of a fresh machine.
    cache = Path(a.workdir) / f"triton-cache-{int(time.time())}"
    settings = ('quant.method="int8"', 'model.dtype="float16"', "server.max_batch_slots=64",
                "server.max_seq_len=2048", "server.max_queue=1024")  # fmt: skip
    t0 = time.perf_counter()
    server = ServerProcess(1, str(ckpt), *settings, env={"TRITON_CACHE_DIR": str(cache)})
    result["server_start_s"] = time.perf_counter() - t0
    try:
        pid = server.rank0_pid()
        # The first burst after ready (nothing warmed by a client), then the same burst again.
        result["phases"]["32-first"] = asyncio.run(load_phase(server.url, 32, 128))
        result["phases"]["32-again"] = asyncio.run(load_phase(server.url, 32, 128))
        result["phases"]["1"] = asyncio.run(load_phase(server.url, 1, 256))
        for clients in (8, 32, 64):
            result["phases"][str(clients)] = asyncio.run(load_phase(server.url, clients, 128))
            print(json.dumps(result["phases"][str(clients)]), flush=True)
        result["sustained"] = {}
        for clients in a.closed_clients:
            result["sustained"][f"closed-{clients}"] = asyncio.run(
                loadgen.closed_loop(server.url, clients, a.sustain_s)
            )
            print(json.dumps(result["sustained"][f"closed-{clients}"]), flush=True)
        for rate in a.rates:
            result["sustained"][f"poisson-{rate:g}"] = asyncio.run(
                loadgen.open_loop(server.url, rate, a.sustain_s)
            )
            print(json.dumps(result["sustained"][f"poisson-{rate:g}"]), flush=True)
        if a.profile:  # after the measured phases: the profiler takes a little of the CPU
            spy = profile(pid, 8, spy_dir / "profile-sustained.txt")
            asyncio.run(loadgen.closed_loop(server.url, 32, 10))
            while spy is not None and spy.poll() is None:
                time.sleep(0.2)
    finally:
        result["server_exit_code"] = server.stop()
        result["server_log_tail"] = server.output()[-4000:]
    # The second start: the same compile cache, now full.
    t0 = time.perf_counter()
    server = ServerProcess(1, str(ckpt), *settings, env={"TRITON_CACHE_DIR": str(cache)})
    result["server_restart_s"] = time.perf_counter() - t0
    server.stop()
    result["server_restart_log_tail"] = server.output()[-1500:]
    result["profile_sustained"] = top_frames(spy_dir / "profile-sustained.txt")
    result["engine"] = engine_steps(str(ckpt), [1, 8, 32, 64], context=128)
    result["transformers"] = transformers_generate(str(ckpt), 32, 128)
    p, e = result["phases"], result["engine"]
    prefill = max(e["prefill_tok_s"].values())
    for row in result["sustained"].values():
        row["ideal_tok_s"] = loadgen.ideal_tok_s(row["prompt_per_output"], prefill,
                                                 e["step_ms"][32])  # fmt: skip
    result.update({
        "served_itl_ms_1client": p["1"]["itl_ms_median"],
        "step_ms_b1": e["step_ms"][1], "step_ms_b32": e["step_ms"][32],
        "served_tok_per_s_32clients": p["32"]["tok_per_s"],
        "transformers_tok_per_s_b32": result["transformers"]["tok_per_s"],
        **{f"ttft_ms_{c}client{'s' if c != '1' else ''}": p[c]["ttft_ms_median"] for c in p},
        **{f"served_tok_per_s_{c}clients": p[c]["tok_per_s"] for c in p if c != "1"},
    })  # fmt: skip
    result["targets"] = {
        "itl_over_step_b1": result["served_itl_ms_1client"] / result["step_ms_b1"],
        "served_32_over_step_capacity": result["served_tok_per_s_32clients"]
        / (32 / (result["step_ms_b32"] / 1e3)),
        "served_32_over_transformers": result["served_tok_per_s_32clients"]
        / result["transformers_tok_per_s_b32"],
        "first_burst_over_warm": p["32-first"]["tok_per_s"] / p["32-again"]["tok_per_s"],
        **{
            f"{k}_over_ideal": r["tok_per_s"] / r["ideal_tok_s"]
            for k, r in result["sustained"].items()
        },
    }
    return result


def serve_gpu_table(r: dict) -> str:
    t, e = r["targets"], r["engine"]
    lines = [
        f"{r['machine'].get('gpu')}, {r['shape']} shape, int8 weights, fp16 activations, "
        f"`mpinfer serve --nproc 1`, streaming /generate_stream clients",
        "",
        md_table(["what", "measured", "target", "ratio"], [
            ["inter-token gap, 1 streaming client (median, 256 tokens)",
             f"{r['served_itl_ms_1client']:.2f} ms", "<= 1.15 x step b=1",
             f"{t['itl_over_step_b1']:.2f} x step b=1 ({r['step_ms_b1']:.2f} ms)"],
            ["32 concurrent clients x 128 tokens", f"{r['served_tok_per_s_32clients']:.0f} tok/s",
             ">= 0.8 x 32 / step b=32",
             f"{t['served_32_over_step_capacity']:.2f} x ({32e3 / r['step_ms_b32']:.0f} tok/s)"],
            ["transformers fp16 generate, batch 32", f"{r['transformers_tok_per_s_b32']:.0f} tok/s",
             "served >= 5 x", f"served = {t['served_32_over_transformers']:.1f} x"],
        ]),
        "",
        md_table(["clients", "tokens/s", "TTFT median ms", "TTFT max ms", "ITL median ms",
                  "ITL p90 ms", "errors"], [
            [c, f"{p['tok_per_s']:.0f}", f"{p['ttft_ms_median']:.1f}", f"{p['ttft_ms_max']:.1f}",
             f"{p['itl_ms_median']:.2f}", f"{p['itl_ms_p90'] or 0:.2f}", p["errors"]]
            for c, p in r["phases"].items()
        ]),
        "",
        md_table(loadgen.PHASE_HEADER, [
            loadgen.phase_row(k, v, v["ideal_tok_s"]) for k, v in r["sustained"].items()
        ]),
        "",
        f"first burst of 32 x 128 after ready (empty compile cache): "
        f"{r['phases']['32-first']['tok_per_s']:.0f} tok/s, the same burst again "
        f"{r['phases']['32-again']['tok_per_s']:.0f} tok/s "
        f"({t['first_burst_over_warm']:.2f} x); start {r['server_start_s']:.0f} s with an empty "
        f"compile cache, {r['server_restart_s']:.0f} s with it full; warm-up "
        f"{e['warm_up_s']:.1f} s, graph capture {e['graph_capture_s']:.1f} s; prefill "
        + ", ".join(f"{k} tokens {v:.0f} tok/s" for k, v in e["prefill_tok_s"].items()),
        "",
        md_table(["engine step (no server)", *[f"b={b}" for b in e["step_ms"]]], [
            ["decode graph replay ms", *[f"{v:.2f}" for v in e["step_ms"].values()]],
            ["with greedy sampling ms", *[f"{v:.2f}" for v in e["step_with_sampling_ms"].values()]],
        ]),
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["engine", "serve"])
    p.add_argument("--workdir", default="/tmp/mpinfer-bench")
    p.add_argument("--out", help="JSON path (default: bench/results/WHAT-cpu.json, or "
                   "serve-gpu-<gpu>.json with --gpu)")  # fmt: skip
    p.add_argument("--seconds", type=float, default=15, help="serve (CPU): seconds per phase")
    p.add_argument("--gpu", action="store_true", help="serve: the served speed on this GPU")
    p.add_argument("--shape", default="bloom-7b1", choices=list(SHAPES), help="with --gpu")
    p.add_argument("--profile", action="store_true", help="with --gpu: py-spy the serving rank")
    p.add_argument(
        "--sustain-s",
        type=float,
        default=20,
        help="with --gpu: seconds per "
        "sustained phase (loadgen.py's mixed prompt and output lengths)",
    )
    p.add_argument(
        "--closed-clients",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[32],
        help="with --gpu: closed-loop client counts (default 32)",
    )
    p.add_argument(
        "--rates",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[8.0, 16.0],
        help="with --gpu: Poisson request rates per second",
    )
    a = p.parse_args(argv)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    if a.gpu:
        if a.what != "serve" or not torch.cuda.is_available():
            print("error: --gpu is for `mpinfer bench serve` on a CUDA GPU", file=sys.stderr)
            return 2
        gpu = torch.cuda.get_device_name().lower().replace(" ", "-")
        a.out = a.out or f"bench/results/serve-gpu-{gpu}.json"
        result = run_serve_gpu(a)
        save_result(result, a.out, serve_gpu_table(result))
        return 0
    a.out = a.out or f"bench/results/{a.what}-cpu.json"
    run, table = {"engine": (run_engine, engine_table), "serve": (run_serve, serve_table)}[a.what]
    result = run(a)
    result["machine"] = {**machine(), "cpus": os.cpu_count()}
    save_result(result, a.out, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
