"""CPU benchmarks (`mpinfer bench load|engine|serve`): each prints a markdown table and writes
JSON (and the table) under bench/results/.

load    random checkpoints of about 0.5, 1 and 2 GB (fp16): the shard command (time, peak RAM),
        start from the HF checkpoint (rank-0 path) and from the sharded directory, at tp 2 and
        4, every rank's anonymous host RSS (start, peak, final), beside transformers'
        from_pretrained(low_cpu_mem_usage=True) of the same checkpoint.
engine  tokens/s of the engine against the number of concurrent requests (1..16), against the
        same requests run one after another, for a tiny and a mid-size model (tp 1).
serve   a load test of the real server (torchrun, tp 2) on 127.0.0.1: requests/s, p50/p99
        latency and time to first token at 1, 8 and 32 concurrent streaming clients, each
        client looping for a fixed time (bounded in count and time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from .dist import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(nproc: int, args: list[str], timeout: float = 900):
    cmd = torchrun_command(nproc, args)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return p, time.perf_counter() - t0


LOADED = re.compile(r"loaded in ([\d.]+) s; anonymous host RAM (.*)")
RANK = re.compile(r"rank (\d+): peak (\d+) MiB \(\+(\d+) over start, final (\d+)\)")


def _load(model: str, tp: int) -> dict:
    p, wall = _torchrun(
        tp, ["launch/generate.py", "--model", model, "--max-new-tokens", "1", "--prompt", "hi"]
    )
    m = LOADED.search(p.stderr)
    ranks = [
        {"peak": int(a), "over_start": int(b), "final": int(c)}
        for _, a, b, c in RANK.findall(m.group(2))
    ]
    return {"load_s": float(m.group(1)), "process_s": wall, "ranks": ranks}


def _hf_baseline(model: str) -> dict:
    code = (
        "import json, time, torch\n"
        "from mpinfer.memory import HostMemoryMonitor\n"
        "from transformers import BloomForCausalLM\n"
        "with HostMemoryMonitor() as m:\n"
        "    t = time.perf_counter()\n"
        f"    BloomForCausalLM.from_pretrained({model!r}, dtype=torch.float16, "
        "low_cpu_mem_usage=True)\n"
        "    t = time.perf_counter() - t\n"
        "print(json.dumps({'load_s': t, 'peak': m.peak_mib, 'start': m.start_mib, "
        "'final': m.end_mib}))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def largest_slice_mib(model: str, tp: int, dtype_bytes: int = 4) -> float:
    """The largest tensor slice a rank holds, in the compute dtype (fp32 on CPU)."""
    from .plan import BloomShape, plan_model

    shape = BloomShape.from_config(json.loads((Path(model) / "config.json").read_text()))
    biggest = 0
    for p in plan_model(shape, tp, quantize=True, quantize_embeddings=False):
        n = 1
        for d in p.rank_shape(tp):
            n *= d
        biggest = max(biggest, n * (1 if p.quantize else dtype_bytes))
    return biggest / 2**20


def run_load(a) -> dict:
    from .tiny import make_tiny

    work = Path(a.workdir)
    rows = []
    for gb in a.sizes:
        layers = max(1, round(gb * 1e9 / (12 * 1024 * 1024 * 2)))  # 12 h^2 fp16 per layer
        src = work / f"hf-{gb}gb"
        if not (src / "config.json").exists():
            make_tiny(
                src,
                layers=layers,
                hidden=1024,
                heads=16,
                vocab=16384,
                shards=4,
                dtype="float16",
                tokenizer_vocab=4096,
            )
        size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
        hf = _hf_baseline(str(src))
        for tp in a.tps:
            out = work / f"sharded-{gb}gb-tp{tp}"
            cmd = [
                sys.executable,
                "-m",
                "mpinfer.cli",
                "shard",
                "--model",
                str(src),
                "--tp",
                str(tp),
                "--out",
                str(out),
            ]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, cwd=ROOT)
            shard_s = time.perf_counter() - t0
            peak = re.search(r"peak anonymous host RAM (\d+) MiB \(\+(\d+) over start\)", p.stdout)
            row = {
                "checkpoint_GB": size,
                "layers": layers,
                "tp": tp,
                "largest_slice_MiB": largest_slice_mib(str(src), tp),
                "shard_s": shard_s,
                "shard_peak_MiB": int(peak.group(1)),
                "shard_over_start_MiB": int(peak.group(2)),
                "rank0_path": _load(str(src), tp),
                "sharded_path": _load(str(out), tp),
                "transformers": hf,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows}


def load_table(result: dict) -> str:
    from .bench import md_table

    def over(ranks):  # the largest peak-over-final of these ranks' host RAM
        return max(k["peak"] - k["final"] for k in ranks) if ranks else 0

    header = ["ckpt GB", "tp", "largest slice MiB", "shard s", "shard peak MiB", "start HF s",
              "start sharded s", "rank 0 peak-final MiB (HF / sharded)",
              "other ranks peak-final MiB (HF / sharded)", "target r0 / others MiB",
              "transformers peak MiB, s"]  # fmt: skip
    rows = []
    for r in result["rows"]:
        h, s, sl = r["rank0_path"], r["sharded_path"], r["largest_slice_MiB"]
        rows.append([
            f"{r['checkpoint_GB']:.2f}", r["tp"], f"{sl:.0f}", f"{r['shard_s']:.1f}",
            r["shard_peak_MiB"], f"{h['process_s']:.1f}", f"{s['process_s']:.1f}",
            f"{over(h['ranks'][:1])} / {over(s['ranks'][:1])}",
            f"{over(h['ranks'][1:])} / {over(s['ranks'][1:])}",
            f"{3 * sl + 256:.0f} / {2 * sl + 256:.0f}",
            f"{r['transformers']['peak']:.0f}, {r['transformers']['load_s']:.1f}",
        ])  # fmt: skip
    return md_table(header, rows)


def run_engine(a) -> dict:
    from .cli import load_tokenizer
    from .config import load_config
    from .dist import init_distributed
    from .engine import Engine
    from .generation import SamplingParams
    from .loader import load_model
    from .tiny import make_tiny

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
        tok = load_tokenizer(str(path))
        params = SamplingParams(max_new_tokens=32)
        prompts = [
            tok.encode(f"request {i} about the river and the king", add_special_tokens=False).ids
            for i in range(16)
        ]
        for n in (1, 2, 4, 8, 16):
            engine = Engine(loaded, ctx, tok, slots=16, max_seq=128)
            t0 = time.perf_counter()
            for p in prompts[:n]:
                engine.submit(p, params, lambda ev: None)
            engine.run(until_idle=True)
            together = engine.generated_tokens / (time.perf_counter() - t0)
            t0, total = time.perf_counter(), 0
            for p in prompts[:n]:
                engine = Engine(loaded, ctx, tok, slots=16, max_seq=128)
                engine.submit(p, params, lambda ev: None)
                engine.run(until_idle=True)
                total += engine.generated_tokens
            alone = total / (time.perf_counter() - t0)
            row = {
                "model": name,
                "concurrent": n,
                "batched_tok_s": together,
                "sequential_tok_s": alone,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows, "tp": 1, "max_new_tokens": 32}


def engine_table(result: dict) -> str:
    from .bench import md_table

    header = ["model", "concurrent requests", "batched tokens/s", "one after another tokens/s",
              "speed-up"]  # fmt: skip
    return md_table(header, [
        [r["model"], r["concurrent"], f"{r['batched_tok_s']:.0f}", f"{r['sequential_tok_s']:.0f}",
         f"{r['batched_tok_s'] / r['sequential_tok_s']:.2f}x"]
        for r in result["rows"]
    ])  # fmt: skip


def run_serve(a) -> dict:
    import httpx

    from .tiny import make_tiny

    path = Path(a.workdir) / "serve-mid"
    if not (path / "config.json").exists():
        make_tiny(path, layers=8, hidden=512, heads=8, vocab=8192)
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        torchrun_command(
            2,
            [
                "launch/serve.py",
                "--model",
                str(path),
                "--port",
                str(port),
                "--set",
                "server.max_batch_slots=32",
                "--set",
                "server.max_seq_len=256",
            ],
        ),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    rows = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        for clients in (1, 8, 32):
            lat, ttft, errors = [], [], 0
            stop_at = time.time() + a.seconds

            def client(i):
                nonlocal errors
                n = 0
                while time.time() < stop_at and n < 1000:
                    n += 1
                    body = {
                        "inputs": f"client {i} asks about the river {n}",
                        "parameters": {"max_new_tokens": 16},
                    }
                    t0 = time.perf_counter()
                    first = None
                    try:
                        with httpx.stream(
                            "POST", url + "/generate_stream", json=body, timeout=60
                        ) as r:
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

            row = {
                "clients": clients,
                "requests": len(lat),
                "errors": errors,
                "req_s": len(lat) / wall,
                "p50_ms": pct(lat, 0.5),
                "p99_ms": pct(lat, 0.99),
                "ttft_p50_ms": pct(ttft, 0.5),
                "ttft_p99_ms": pct(ttft, 0.99),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    return {"rows": rows, "model": "mid (8x512, 29M params)", "tp": 2, "max_new_tokens": 16}


def serve_table(result: dict) -> str:
    from .bench import md_table

    header = ["clients", "requests", "errors", "requests/s", "p50 ms", "p99 ms", "TTFT p50 ms",
              "TTFT p99 ms"]  # fmt: skip
    return md_table(header, [
        [r["clients"], r["requests"], r["errors"], f"{r['req_s']:.1f}", f"{r['p50_ms']:.0f}",
         f"{r['p99_ms']:.0f}", f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}"]
        for r in result["rows"]
    ])  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("load", "engine", "serve"):
        s = sub.add_parser(name)
        s.add_argument("--workdir", default="/tmp/mpinfer-bench")
        s.add_argument("--out", default=f"bench/results/{name}-cpu.json")
    sub.choices["load"].add_argument("--sizes", type=float, nargs="+", default=[0.5, 1, 2])
    sub.choices["load"].add_argument("--tps", type=int, nargs="+", default=[2, 4])
    sub.choices["serve"].add_argument("--seconds", type=float, default=15)
    a = p.parse_args(argv)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    run, table = {
        "load": (run_load, load_table),
        "engine": (run_engine, engine_table),
        "serve": (run_serve, serve_table),
    }[a.what]
    result = run(a)
    from .bench import machine, save_result

    result["machine"] = {**machine(), "cpus": os.cpu_count()}
    save_result(result, a.out, table(result))
    return 0
