"""The engine and the server under load, measured the way a user measures them.

    mpinfer bench engine        (CPU) tokens/s of the engine against the number of concurrent
                                requests (1..16), against the same requests one after another
    mpinfer bench serve         (CPU) the real server (`mpinfer serve --nproc 2`, the mid model)
                                on 127.0.0.1: requests/s, p50/p99 latency and time to first
                                token at 1, 8 and 32 concurrent streaming clients
    mpinfer bench serve --gpu   the served speed on a GPU (servegpu.py): bursts, sustained
                                mixed traffic, cold and warm starts, the engine's step and the
                                transformers baseline in one run

Each prints a markdown table and writes JSON (and the table) under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from ..checkpoint.loader import load_model
from ..config import load_config
from ..dist import init_distributed, teardown
from ..engine.engine import Engine
from ..engine.runner import ModelRunner
from ..engine.sampling import SamplingParams
from ..startup.runtime import load_tokenizer
from .randmodel import SHAPES
from .report import machine, md_table, save_result
from .servegpu import run_serve_gpu, serve_gpu_table
from .serverproc import ServerProcess
from .tiny import make_tiny


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


def run_serve(a) -> dict:
    """CPU: the mid model on 2 ranks, streaming clients looping for a fixed time."""
    path = Path(a.workdir) / "serve-mid"
    if not (path / "config.json").exists():
        make_tiny(path, layers=8, hidden=512, heads=8, vocab=8192)
    server = ServerProcess(2, str(path), "server.max_batch_slots=32", "server.max_seq_len=256")
    rows = []
    try:
        rows.append(parse_phase(server.url, a.seconds))
        print(json.dumps(rows[-1]), flush=True)
        for clients in () if a.parse_only else (1, 8, 32):
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


PARSE_BODY = {"inputs": "the river", "parameters": {
    "max_new_tokens": 1, "do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.95,
    "typical_p": 0.99, "repetition_penalty": 1.1, "frequency_penalty": 0.1, "seed": 7,
    "stop": ["\n\n", "###"], "details": True, "return_full_text": False, "truncate": 200,
    "top_n_tokens": 2, "decoder_input_details": False}}  # fmt: skip


def parse_phase(url: str, seconds: float, clients: int = 8) -> dict:
    """Requests per second of /generate for one token with every TGI parameter set: the HTTP
    layer's cost (reading, validating, answering) more than the model's."""
    done, errors, lat = [0], [0], []
    stop_at = time.time() + seconds

    def client():
        with httpx.Client(timeout=60) as c:
            while time.time() < stop_at:
                t0 = time.perf_counter()
                r = c.post(url + "/generate", json=PARSE_BODY)
                lat.append(time.perf_counter() - t0)
                done[0] += 1
                errors[0] += r.status_code != 200

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    p = lat[len(lat) // 2] * 1e3 if lat else float("nan")
    q = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3 if lat else float("nan")
    return {"clients": f"{clients} x /generate, 1 token, every parameter", "requests": done[0],
            "errors": errors[0], "req_s": done[0] / wall, "p50_ms": p, "p99_ms": q,
            "ttft_p50_ms": p, "ttft_p99_ms": q}  # fmt: skip


def serve_table(result: dict) -> str:
    header = ["clients", "requests", "errors", "requests/s", "p50 ms", "p99 ms", "TTFT p50 ms",
              "TTFT p99 ms"]  # fmt: skip
    return md_table(header, [
        [r["clients"], r["requests"], r["errors"], f"{r['req_s']:.1f}", f"{r['p50_ms']:.0f}",
         f"{r['p99_ms']:.0f}", f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}"]
        for r in result["rows"]
    ])  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["engine", "serve"])
    p.add_argument("--workdir", default="/tmp/mpinfer-bench")
    p.add_argument("--out", help="JSON path (default: bench/results/WHAT-cpu.json, or "
                   "serve-gpu-<gpu>.json with --gpu)")  # fmt: skip
    p.add_argument("--seconds", type=float, default=15, help="serve (CPU): seconds per phase")
    p.add_argument("--gpu", action="store_true", help="serve: the served speed on this GPU")
    p.add_argument("--parse-only", action="store_true",
                   help="serve (CPU): only the request-parsing row")  # fmt: skip
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
