"""`mpinfer bench serve --gpu`: the served speed on a GPU, as a user measures it, in one run.

Writes a random checkpoint of a real shape (default bloom-7b1) and starts `mpinfer serve --nproc
1` with an empty compile cache of its own (a fresh machine's start). Through HTTP: the first
burst of 32 x 128 tokens after ready and the same burst again; one client's inter-token gap
over 256 tokens; bursts of 8, 32 and 64; sustained mixed traffic (loadgen.py: closed-loop clients
and Poisson rates), with GPU utilization and memory. Then a second start on the now-full cache,
the engine's own step without the server (graph replay at 1..64 rows, prefill at 512 and 2048
tokens), the mix's ideal from those, and transformers fp16 `generate` at batch 32 on the same
checkpoint. `--profile` records the serving rank with py-spy under sustained load. What is not
here: the CPU benchmarks and the command line (servebench.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import torch

from ..checkpoint.loader import load_model
from ..config import load_config
from ..dist import init_distributed, teardown
from ..engine.runner import ModelRunner
from ..engine.sampling import Row, Sampler, SamplingParams
from ..engine.step import Prefill, Step
from ..extras import require
from ..startup.runtime import load_tokenizer
from . import loadgen
from .randmodel import SHAPES, decode_step, fill_context
from .report import cuda_time, machine, md_table
from .serverproc import ServerProcess, load_phase
from .tiny import make_tiny


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
