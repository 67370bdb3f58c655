"""Where a served mixed step's time goes (a diagnostic for the mixed-step issue; GPU only):

    python -m mpinfer.tools.diag.mixed_step [--shape bloom-7b1] [--quant int8] [--seconds 20]

1. The engine in this process (a random model built on the GPU, 32 slots, step graphs; no HTTP)
   under the load generator's unique mix, closed loop: for every step its tokens, decode rows,
   the GPU's time on the forward and on the sampler (CUDA events), the GPU's idle gap before
   it, and the host's time to plan and launch it and to read its results. Summed by bucket.
2. Synthetic steps of 32 decode rows (context 512) and one prompt chunk, up to 512 tokens: the
   forward's GPU time, replayed from the step graphs; the decode step again over scattered
   blocks (a served pool's tables). With --prefill, the closed loop first runs at each other
   prompt-token budget a step (rate, TTFT and ITL of its steady window).
3. The kernels of the decode step and of a 100-token step (eager, the same launches the graph
   holds), by family.
--kv-int8 runs it all over an int8 KV cache; --dequant-rows N moves the row count past which a
launch dequantizes its weight (kernels.FORCE_DEQUANT_ROWS; default: the GPU's table, else
kernels.DEQUANT_ROWS); --step-tokens caps a step's tokens (server.max_step_tokens, default 512;
0: no cap); --quick stops after the closed loop; --sample makes the requests sample at
temperature 1, as the OpenAI routes do when a request names none (the load generator's);
--one-scan-draw puts back the sampler's draw before round 10 (one float64 scan per row);
--slots gives the engine more slots than clients (the served 24 GiB server has 64).
Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import tempfile
import threading
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ...dist import DistContext
from ...engine import sampling
from ...engine.engine import Engine
from ...engine.sampling import SamplingParams
from ...engine.step import Prefill, Step
from ...model import kernels
from ...startup.runtime import load_tokenizer
from .. import loadgen
from ..randmodel import build_random, fill_context, make_runner
from ..report import cuda_time
from ..tiny import make_tiny
from .sampler_cost import one_scan_draw


def drive(engine: Engine, tok, clients: int, seconds: float, sample: bool = False) -> dict:
    """Closed loop of `clients` requests of the unique mix through the engine; per-step
    records from wrapped engine methods. `sample`: temperature 1 (what the OpenAI routes do
    when a request names no temperature), else greedy."""
    runner, steps, by_index = engine.runner, [], {}
    launch, execute, complete = engine._launch_next, runner.execute, engine._complete

    def timed_execute(step, *a, **k):
        rec = steps[-1]
        rec["tokens"] = len(step.decode_slots) + sum(len(p.tokens) for p in step.prefills)
        rec["decode"], rec["prefills"] = len(step.decode_slots), len(step.prefills)
        rec["ctx"] = sum(step.decode_pos) / max(1, len(step.decode_pos))
        rec["sampled"] = len(step.decode_slots) + sum(p.sample for p in step.prefills)
        rec["bucket"] = runner.bucket(rec["tokens"])
        out = execute(step, *a, **k)
        rec["mid"] = torch.cuda.Event(enable_timing=True)
        rec["mid"].record()
        return out

    def timed_launch():
        rec = {"start": torch.cuda.Event(enable_timing=True), "t0": time.perf_counter()}
        steps.append(rec)
        rec["start"].record()
        got = launch()
        if got is None:
            steps.pop()
            return got
        rec["end"] = torch.cuda.Event(enable_timing=True)
        rec["end"].record()
        rec["launch_ms"] = (time.perf_counter() - rec["t0"]) * 1e3
        by_index[got.index] = rec
        return got

    def timed_complete(f):
        t0 = time.perf_counter()
        if f.ready is not None:
            f.ready.synchronize()
        t1 = time.perf_counter()
        complete(f)
        rec = by_index[f.index]
        rec["complete_ms"], rec["wait_ms"] = (time.perf_counter() - t1) * 1e3, (t1 - t0) * 1e3

    engine._launch_next, engine._complete = timed_launch, timed_complete
    runner.execute = timed_execute
    work = [(tok.encode(p).ids, n) for p, n in loadgen.mixed_requests(20_000, 0)]
    done: queue.Queue = queue.Queue()
    reqs: list[list[float]] = []  # per request: its submit time, then each token's

    def submit(i: int) -> None:
        ids, n = work[i]
        ids = ids[: runner.max_seq - n]  # a small vocabulary's tokenizer makes longer prompts
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, seed=i, do_sample=sample)
        times = [time.perf_counter()]
        reqs.append(times)

        def sink(ev, times=times):
            if ev.kind == "token":
                times.append(time.perf_counter())
            elif ev.kind in ("done", "error"):
                done.put(ev.kind)

        engine.submit(ids, params, sink)

    thread = threading.Thread(target=engine.run, kwargs={"stop_ranks": False}, daemon=True)
    thread.start()
    t0, sent = time.perf_counter(), 0
    for _ in range(clients):
        submit(sent)
        sent += 1
    while time.perf_counter() - t0 < seconds:
        try:
            done.get(timeout=0.1)
        except queue.Empty:
            continue
        submit(sent)
        sent += 1
    end = time.perf_counter()
    engine.cancel_all()
    engine.stop()
    thread.join()
    engine._launch_next, runner.execute, engine._complete = launch, execute, complete
    torch.cuda.synchronize()
    lo = t0 + seconds / 4  # past the ramp
    rows = []
    for i, r in enumerate(steps):
        if "end" not in r or r["t0"] < lo or r["t0"] > end:
            continue
        keys = ("tokens", "decode", "ctx", "prefills", "sampled", "bucket", "launch_ms",
                "complete_ms")  # fmt: skip
        row = {k: r.get(k) for k in (*keys, "wait_ms")}
        row["forward_ms"] = r["start"].elapsed_time(r["mid"])
        row["sample_ms"] = r["mid"].elapsed_time(r["end"])
        if i and "end" in steps[i - 1]:
            row["gap_ms"] = max(0.0, steps[i - 1]["end"].elapsed_time(r["start"]))
        rows.append(row)
    # prompt tokens per output token in the window: every step's prompt tokens over its sampled
    # rows (decode rows and prompts' last chunks)
    prompt = sum(r["tokens"] - r["decode"] for r in rows)
    out = sum(r["sampled"] for r in rows)
    # the load generator's steady figures, over this loop's requests (a token an event)
    results = [{"start": t[0], "times": t[1:], "output_tokens": len(t) - 1} for t in reqs]
    return {"steady_tok_per_s": loadgen.steady_rate(results, lo, end), "requests": sent,
            "steps": rows, "prompt_per_output": prompt / max(1, out),
            **loadgen.steady_latency(results, lo, end)}  # fmt: skip


def summarize(rows: list[dict]) -> list[dict]:
    by = defaultdict(list)
    for r in rows:
        by[r["bucket"]].append(r)
    out = []
    for b in sorted(by):
        rs = by[b]

        def mean(k, rs=rs):
            v = [r[k] for r in rs if r.get(k) is not None]
            return sum(v) / len(v) if v else 0.0

        keys = (
            "tokens",
            "decode",
            "ctx",
            "forward_ms",
            "sample_ms",
            "gap_ms",
            "launch_ms",
            "complete_ms",
        )
        out.append({"bucket": b, "steps": len(rs), **{k: mean(k) for k in keys}})
    return out


FAMILIES = [("int8/int4 matmul", r"w8a16|w4a16|matmul_|_mm_|linear"),
            ("cuBLAS", r"gemm|cutlass|sm90|sm80|cublas|nvjet"),
            ("attention", r"attn|attention|flash"), ("layernorm", r"norm"),
            ("gelu/elementwise", r"elementwise|gelu|add|mul|copy|fill|where|index")]  # fmt: skip


def kernel_families(runner, step: Step) -> tuple[list[dict], dict]:
    runner.execute(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.execute(step)
        torch.cuda.synchronize()
    rows, fam = [], defaultdict(float)
    for e in prof.key_averages():
        us = (getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) / 5
        if us <= 0:
            continue
        rows.append({"kernel": e.key[:100], "calls": e.count // 5, "us": us})
        name = next((f for f, rx in FAMILIES if re.search(rx, e.key, re.I)), "other")
        fam[name] += us
    return sorted(rows, key=lambda r: -r["us"])[:25], dict(fam)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="bloom-7b1")
    ap.add_argument("--quant", default="int8")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--slots", type=int, default=0, help="the engine's slots (0: --clients)")
    ap.add_argument(
        "--prefill",
        default="512",
        help="comma list of the engine's prompt-token budgets a step, one run each",
    )
    ap.add_argument("--kv-int8", action="store_true", help="int8 keys and values")
    ap.add_argument(
        "--dequant-rows",
        type=int,
        default=0,
        help="launches of more rows dequantize their weight (0: as shipped for this GPU)",
    )
    ap.add_argument("--step-tokens", type=int, default=512, help="a step's most tokens (0: no cap)")
    ap.add_argument("--quick", action="store_true", help="the closed loop only")
    ap.add_argument("--sample", action="store_true", help="requests sample at temperature 1")
    ap.add_argument("--one-scan-draw", action="store_true", help="the draw before round 10")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.dequant_rows:
        kernels.FORCE_DEQUANT_ROWS = a.dequant_rows
    if a.one_scan_draw:
        sampling.draw = one_scan_draw
    model, shape, tp = build_random(a.shape, a.quant)
    tokdir = tempfile.mkdtemp()
    make_tiny(tokdir, layers=1, hidden=64, heads=4, vocab=shape.vocab_size, shards=1)
    tok = load_tokenizer(tokdir)
    ctx = DistContext(0, 1, 0, torch.device("cuda"), None, None)
    slots = a.slots or a.clients
    runner = make_runner(model, shape, tp, slots=slots, max_seq=2048, num_blocks=2048,
                         kv_int8=a.kv_int8, max_step_tokens=a.step_tokens)  # fmt: skip
    result = {"shape": a.shape, "quant": a.quant, "gpu": torch.cuda.get_device_name(),
              "kv": "int8" if a.kv_int8 else "model dtype",
              "dequant_rows": kernels.FORCE_DEQUANT_ROWS or "as shipped",
              "step_tokens": a.step_tokens, "buckets": runner.buckets, "slots": slots,
              "sampling": ("temperature 1" if a.sample else "greedy")
              + (", one-scan draw" if a.one_scan_draw else "")}  # fmt: skip
    budgets = [int(v) for v in a.prefill.split(",")]
    for budget in budgets[1:]:  # the first budget's run is the detailed one, below
        engine = Engine(runner, ctx, tok, max_queue=4096, max_prefill_tokens=budget)
        engine.warm_up()
        got = drive(engine, tok, a.clients, a.seconds, a.sample)
        del got["steps"]
        result[f"prefill_{budget}"] = got
        print(
            f"prompt budget {budget}: "
            + json.dumps({k: v if v is None else round(v, 2) for k, v in got.items()})
        )
    engine = Engine(runner, ctx, tok, max_queue=4096, max_prefill_tokens=budgets[0])
    engine.warm_up()
    result.update(drive(engine, tok, a.clients, a.seconds, a.sample))
    result["by_bucket"] = summarize(result["steps"])
    rows = result["steps"]
    wall = sum(r["forward_ms"] + r["sample_ms"] + r.get("gap_ms", 0) for r in rows)
    print(
        f"\nengine in-process, {a.clients} clients, unique mix, {result['sampling']}: steady "
        f"{result['steady_tok_per_s']:.0f} tok/s, {len(rows)} steps; GPU forward "
        f"{sum(r['forward_ms'] for r in rows) / wall:.0%}, sampler "
        f"{sum(r['sample_ms'] for r in rows) / wall:.0%}, idle gaps "
        f"{sum(r.get('gap_ms', 0) for r in rows) / wall:.0%} of the GPU timeline; prompt "
        f"budget {budgets[0]}; TTFT p50/p99 {result['steady_ttft_ms_p50']:.0f}/"
        f"{result['steady_ttft_ms_p99']:.0f} ms, ITL p50/p99 {result['steady_itl_ms_p50']:.1f}/"
        f"{result['steady_itl_ms_p99']:.1f} ms (steady)"
    )
    print(
        f"{'bucket':>6}{'steps':>7}{'tokens':>8}{'decode':>8}{'ctx':>6}{'fwd ms':>8}{'samp ms':>8}"
        f"{'gap ms':>8}{'launch':>8}{'complete':>9}"
    )
    for s in result["by_bucket"]:
        print(
            f"{s['bucket']:>6}{s['steps']:>7}{s['tokens']:>8.1f}{s['decode']:>8.1f}{s['ctx']:>6.0f}"
            f"{s['forward_ms']:>8.2f}{s['sample_ms']:>8.2f}{s['gap_ms']:>8.2f}"
            f"{s['launch_ms']:>8.2f}{s['complete_ms']:>9.2f}"
        )
    del engine
    if a.quick:
        return save(result, a.out)
    ctx_len, rows = 512, a.clients  # about the served decode rows' context (the table's ctx)
    runner = make_runner(model, shape, tp, slots=rows + 3, max_seq=1088, kv_int8=a.kv_int8)
    fill_context(runner, rows, ctx_len)
    dec = dict(decode_slots=tuple(range(rows)), decode_pos=(ctx_len,) * rows)
    synth = {}
    for total in (rows, 64, 100, 128, 256, 512):
        chunk = total - rows
        pf = (Prefill(rows + 1, 0, tuple(range(5, 5 + chunk)), sample=True),) if chunk else ()
        step = Step(**dec, prefills=pf)
        synth[total] = cuda_time(lambda step=step: runner.execute(step), iters=20)
    for c in (128, ctx_len):  # the ideal prices decode rows at context 128
        step = Step(decode_slots=dec["decode_slots"], decode_pos=(c,) * rows)
        synth[f"decode b{rows} ctx {c}"] = cuda_time(lambda step=step: runner.execute(step),
                                                     iters=20)  # fmt: skip
    big = Step(prefills=(Prefill(rows + 2, 0, tuple(range(5, 1029)), sample=True),))
    synth["prefill 1024 tok/s"] = 1024 / cuda_time(lambda: runner.execute(big), iters=5) * 1e3
    ppo, best = result["prompt_per_output"], synth["prefill 1024 tok/s"]
    result["ideal_tok_s"] = {c: loadgen.ideal_tok_s(ppo, best, synth[f"decode b{rows} ctx {c}"])
                             for c in (128, ctx_len)}  # fmt: skip
    print(f"\nprompt tokens per output {ppo:.2f}; the mix's ideal (prefill {best:,.0f} tok/s, "
          "decode rows at context 128 / 512): " + " / ".join(
              f"{v:,.0f} tok/s ({result['steady_tok_per_s'] / v:.2f} x)"
              for v in result["ideal_tok_s"].values()))  # fmt: skip
    tables = runner.cache.tables
    perm = torch.randperm(runner.cache.num_blocks, device=tables.device)
    tables.copy_(perm[tables])  # the same rows over scattered blocks
    synth["decode, scattered blocks"] = cuda_time(lambda: runner.execute(Step(**dec)), iters=20)
    result["synthetic_forward_ms"] = synth
    print(
        f"\nsynthetic steps, {rows} decode rows (context {ctx_len}) + one chunk (graph "
        "replay, ms): " + ", ".join(f"{k} tok {v:.2f}" for k, v in synth.items())
    )
    runner = None  # its cache and graphs go before the eager one
    eager = make_runner(model, shape, tp, slots=rows + 3, max_seq=1024, cuda_graphs=False,
                        kv_int8=a.kv_int8)  # fmt: skip
    fill_context(eager, rows, ctx_len)
    for name, step in (
        ("decode", Step(**dec)),
        (
            "100-token",
            Step(**dec, prefills=(Prefill(rows + 1, 0, tuple(range(5, 105 - rows)), sample=True),)),
        ),
    ):
        top, fam = kernel_families(eager, step)
        result[f"kernels_{name}"], result[f"families_{name}"] = top, fam
        print(f"\nkernels of the {name} step, eager, us a step:")
        for f, us in sorted(fam.items(), key=lambda x: -x[1]):
            print(f"  {f:<22}{us:10.0f}")
        for r in top[:12]:
            print(f"  {r['us']:9.0f} us {r['calls']:4d}x  {r['kernel']}")
    save(result, a.out)


def save(result: dict, out: str) -> None:
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, default=str)


if __name__ == "__main__":
    main()
