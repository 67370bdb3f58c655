"""`mpinfer bench gpu`: decode and prefill speed on one GPU, side by side with the baselines.

One run measures, in this order: the device-to-device copy bandwidth and the bf16 matmul rate of
this GPU (the ceilings), then for a random BLOOM of a given shape (weights made on the GPU, no
checkpoint) mpinfer int8, fp16 and llm.int8, transformers fp16 and transformers + bitsandbytes
8-bit: ms per decode step at batch 1, 8 and 32 after a context of 512, prefill time for 512
and 2048 tokens (median of 5), peak GPU memory, and each row's floor (weight bytes / copy
bandwidth).
mpinfer's decode step is the engine's: `ModelRunner.execute` of a decode step, which replays
the same captured graph the server replays. `--simulate-tp 8` adds one rank's shard of
BLOOM-176B at tp 8 (collectives skipped and counted). Writes JSON and a markdown table under
bench/results/. What is not here: CPU benchmarks (loadbench.py, servebench.py), the served
speed on a GPU (servegpu.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..config import load_config
from ..engine.step import Prefill, Step
from ..extras import require
from ..model.memory import plan_memory
from .memcheck import MEMORY_CASES, memory_check, memory_check_table
from .offloadbench import markdown as offload_markdown
from .offloadbench import run_offload
from .randmodel import (
    SHAPES,
    build_random,
    decode_step,
    fill_context,
    free_gpu,
    make_runner,
    weight_bytes,
)
from .report import cuda_time, machine, md_table, measure_ceilings, save_result

ROOT = Path(__file__).resolve().parents[2]


def profile_step(step, iters: int = 5) -> list[dict]:
    """Per-kernel GPU time of one decode step: where the time goes."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls": e.count // iters, "us": us / iters})
    return sorted(rows, key=lambda r: -r["us"])[:15]


def bench_mpinfer(
    model, shape, tp, *, batches, context, prefill_lens, use_graph=True, profile=False
) -> dict:
    """The engine's decode step (runner.execute of a decode-only step: the graph the server
    replays) at each batch size after `context` cached tokens, and prefill times."""
    out = {"decode_ms": {}, "prefill_ms": {}}
    runner = make_runner(model, shape, tp, slots=max(batches), max_seq=context + 64,
                         cuda_graphs=use_graph)  # fmt: skip
    fill_context(runner, max(batches), context)
    out["graph_capture_s"], out["graph_MiB"] = runner.capture_seconds, runner.capture_bytes / 2**20
    for B in batches:
        step = decode_step(B, context)
        out["decode_ms"][B] = cuda_time(lambda: runner.execute(step), iters=30 if use_graph else 10)
        if B in (1, 32) and profile:
            out[f"kernels_b{B}"] = profile_step(lambda: runner.execute(step))
    runner = None  # free its cache before the prefill runners
    for T in prefill_lens:
        runner = make_runner(model, shape, tp, slots=1, max_seq=T, cuda_graphs=False)
        tokens = tuple(torch.randint(4, shape.vocab_size, (T,)).tolist())
        step = Step(prefills=(Prefill(0, 0, tokens, sample=True),))
        out["prefill_ms"][T] = cuda_time(lambda: runner.execute(step), iters=5, warmup=2,
                                           median=True)  # fmt: skip
    return out


def build_hf(shape_name: str, *, int8: bool):
    transformers = require("transformers")
    shape = SHAPES[shape_name]
    cfg = transformers.BloomConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
    )
    with torch.device("cuda"):
        model = transformers.BloomForCausalLM(cfg).to(torch.float16).eval()
    if int8:  # what load_in_8bit does: every block Linear becomes a bnb Linear8bitLt
        bnb = require("bitsandbytes")

        for block in model.transformer.h:
            for parent in (block.self_attention, block.mlp):
                for name, lin in list(parent.named_children()):
                    if isinstance(lin, torch.nn.Linear):
                        new = bnb.nn.Linear8bitLt(
                            lin.in_features,
                            lin.out_features,
                            bias=True,
                            has_fp16_weights=False,
                            threshold=6.0,
                        )
                        # Quantized on the GPU, as Int8Params.to("cuda") does for CPU weights.
                        cb, scb, _ = bnb.functional.int8_vectorwise_quant(lin.weight.data.half())
                        new.weight = bnb.nn.Int8Params(
                            cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb
                        )
                        new.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
                        setattr(parent, name, new)
    return model


@torch.inference_mode()
def bench_hf(model, vocab: int, *, batches, context, prefill_lens, steps: int) -> dict:
    out = {"decode_ms": {}, "prefill_ms": {}}
    for B in batches:
        ids = torch.randint(4, vocab, (B, context), device="cuda")
        mask = torch.ones_like(ids)
        past = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        token = ids[:, -1:]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            mask = torch.ones((B, context + i + 1), dtype=torch.long, device="cuda")
            past = model(
                input_ids=token, attention_mask=mask, past_key_values=past, use_cache=True
            ).past_key_values
        torch.cuda.synchronize()
        out["decode_ms"][B] = (time.perf_counter() - t0) / steps * 1e3
        del past
    for T in prefill_lens:
        ids = torch.randint(4, vocab, (1, T), device="cuda")
        out["prefill_ms"][T] = cuda_time(
            lambda: model(input_ids=ids, logits_to_keep=1), iters=5, warmup=2, median=True
        )
    return out


def run_gpu(args) -> dict:
    ceil = measure_ceilings()
    bw = ceil["copy_bandwidth_GBps"] * 1e9
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    batches, ctx, pre = tuple(args.batches), args.context, (512, 2048)
    rows = []
    for label, kind in args.rows:
        free_gpu()
        t0 = time.perf_counter()
        if kind.startswith("hf"):
            model = build_hf(args.shape, int8=kind == "hf-int8")
            block_params = sum(p.numel() for p in model.transformer.h.parameters())
            build_s = time.perf_counter() - t0
            res = bench_hf(
                model,
                SHAPES[args.shape].vocab_size,
                batches=batches,
                context=ctx,
                prefill_lens=pre,
                steps=20 if kind == "hf-int8" else 40,
            )
        else:
            model, shape, tp = build_random(args.shape, kind)
            # the block matrices' weights (int4 packs two a byte)
            block_params = sum(p.numel() * (2 if p.dtype == torch.uint8 else 1)
                               for n, p in model.h.named_parameters()
                               if n.endswith(".weight") and p.dim() == 2)  # fmt: skip
            build_s = time.perf_counter() - t0
            res = bench_mpinfer(
                model,
                shape,
                tp,
                batches=batches,
                context=ctx,
                prefill_lens=pre,
                use_graph=kind != "llm.int8",
                profile=kind == "int8",
            )
        # A decode step reads every weight once (the tied embedding as the LM head): the floor
        # is all weight bytes, as this row stores them, over the measured copy bandwidth.
        wbytes = weight_bytes(model)
        floor_ms = wbytes / bw * 1e3
        row = {
            "row": label,
            "weight_GB": wbytes / 1e9,
            "floor_ms": floor_ms,
            "build_s": build_s,
            "peak_GB": torch.cuda.max_memory_allocated() / 1e9,
            **res,
        }
        # Prefill work: 2 FLOPs per block weight per token (attention scores not counted).
        row["prefill_TFLOPs"] = {
            T: 2 * block_params * T / (ms / 1e3) / 1e12 for T, ms in res["prefill_ms"].items()
        }
        rows.append(row)
        print(json.dumps(row))
        del model
    sims = [simulate_tp(args.simulate_tp, bw, dt) for dt in ("fp16", "bf16") if args.simulate_tp]
    memory = []
    if args.memory:
        for case in MEMORY_CASES:
            try:
                memory.append(memory_check(*case))
            except Exception as e:  # one failing case must not lose the rows measured above
                memory.append({"case": case[0], "error": f"{type(e).__name__}: {e}"})
    for m in memory:
        print(json.dumps(m))
    return {
        "machine": machine(),
        "ceilings": ceil,
        "shape": args.shape,
        "context": ctx,
        "rows": rows,
        "simulate_tp": sims,
        "memory": memory,
    }


def simulate_tp(tp_size: int, bw: float, dtype: str = "fp16") -> dict:
    free_gpu()
    model, shape, tp = build_random("bloom-176b", f"int8:emb8@{dtype}", tp_size=tp_size)
    wbytes = weight_bytes(model)
    res = bench_mpinfer(model, shape, tp, batches=(1, 8, 32), context=512, prefill_lens=(),
                        profile=True)  # fmt: skip
    step_ms = res["decode_ms"][1]
    tp.skipped.clear()
    free_gpu()  # the peak below: weights + a 2048-token cache + one step's activations
    runner = make_runner(model, shape, tp, slots=1, max_seq=2048, cuda_graphs=False)
    runner.execute(decode_step(1, 0))
    peak = torch.cuda.max_memory_allocated() / 1e9
    runner = None
    kv = {name: kv_at_24gib(model, shape, tp, name) for name in ("auto", "int8")}
    return {
        "kv_24GiB": kv,
        "tp_size": tp_size,
        "activations": dtype,
        "weight_GB": wbytes / 1e9,
        "floor_ms": wbytes / bw * 1e3,
        "decode_ms": res["decode_ms"],
        "ratio_to_floor": step_ms / (wbytes / bw * 1e3),
        "collectives_per_step_skipped": dict(tp.skipped),
        **{k: v for k, v in res.items() if k.startswith("kernels")},
        "peak_GB_with_2048_token_cache": peak,
    }


def kv_at_24gib(model, shape, tp, kv_dtype: str, request: int = 768, context: int = 640) -> dict:
    """BLOOM-176B's rank on a 24 GiB card: as many sequences of `request` (512 + 256) tokens as
    the planner puts in its KV blocks, each `context` tokens in, and the decode step of all of
    them at once (a captured graph), beside the same batch on the static layout's blocks."""
    free_gpu()
    cfg = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"),
                      [f'server.kv_cache_dtype="{kv_dtype}"'])  # fmt: skip
    plan = plan_memory(shape, cfg, tp_size=tp.tp_size, budget=24 * 2**30)
    n, per = plan.sequences(request), -(-request // 16)
    runner = make_runner(model, shape, tp, slots=n, max_seq=2048, block_size=16,
                         num_blocks=plan.kv_blocks, kv_int8=kv_dtype == "int8",
                         max_prefill_tokens=256)  # fmt: skip
    rows = torch.arange(n * per, device="cuda").view(n, per)  # row r on its own 48 blocks
    runner.cache.tables[:, :per] = rows
    fill_context(runner, n, context)
    step = decode_step(n, context)
    step_ms = cuda_time(lambda: runner.execute(step), iters=20)
    cache_gib = (
        sum(
            t.numel() * t.element_size()
            for t in runner.cache.k
            + runner.cache.v
            + (runner.cache.k_scale or [])
            + (runner.cache.v_scale or [])
        )
        / 2**30
    )
    peak = torch.cuda.max_memory_allocated() / 2**30
    return {
        "kv_cache_dtype": kv_dtype,
        "kv_tokens": plan.kv_tokens,
        "kv_blocks": plan.kv_blocks,
        "sequences_512_256": n,
        "static_slots_2048": plan.slots,
        "decode_ms": step_ms,
        "cache_GiB": cache_gib,
        "peak_GiB": peak,
        "planned_GiB": (plan.fixed + plan.kv_blocks * 16 * plan.kv_bytes_per_token) / 2**30,
    }


def _ms(d: dict, batch: int) -> str:
    return f"{d[batch]:.2f}" if batch in d else "-"


def markdown(result: dict) -> str:
    c = result["ceilings"]
    header = ["row", "weights GB", "floor ms", "decode ms b=1", "b=8", "b=32", "b=1 / floor",
              "prefill 512 ms", "prefill 2048 ms", "2048 TFLOP/s", "peak GB"]  # fmt: skip
    rows = []
    for r in result["rows"]:
        d, p = r["decode_ms"], r["prefill_ms"]
        ratio = f"{d[1] / r['floor_ms']:.2f}" if 1 in d else "-"
        rows.append([r["row"], f"{r['weight_GB']:.2f}", f"{r['floor_ms']:.2f}", _ms(d, 1),
                     _ms(d, 8), _ms(d, 32), ratio, f"{p[512]:.1f}",
                     f"{p[2048]:.1f}", f"{r['prefill_TFLOPs'][2048]:.0f}",
                     f"{r['peak_GB']:.1f}"])  # fmt: skip
    lines = [
        f"{result['machine'].get('gpu', 'cpu')}: copy {c['copy_bandwidth_GBps'] / 1e3:.2f} TB/s, "
        f"bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s; shape {result['shape']}, context "
        f"{result['context']}",
        "",
        md_table(header, rows),
    ]
    for s in result.get("simulate_tp") or []:
        d = s["decode_ms"]
        lines += [
            "",
            f"BLOOM-176B, one rank of tp={s['tp_size']}, {s['activations']} activations "
            "(collectives skipped: "
            f"{s['collectives_per_step_skipped']} per step): int8 weights {s['weight_GB']:.2f} GB, "
            f"floor {s['floor_ms']:.2f} ms, decode b=1 {d[1]:.2f} ms "
            f"({s['ratio_to_floor']:.2f} x the floor), "
            f"b=8 {d[8]:.2f} ms, b=32 {d[32]:.2f} ms; peak GPU memory with a 2048-token cache "
            f"{s['peak_GB_with_2048_token_cache']:.2f} GB",
        ]
        for kv in (s.get("kv_24GiB") or {}).values():
            lines.append(
                f"- on a 24 GiB card, KV cache {kv['kv_cache_dtype']}: {kv['kv_tokens']} tokens "
                f"in {kv['kv_blocks']} blocks = {kv['sequences_512_256']} sequences of 512+256 "
                f"at once (static slots of 2048: {kv['static_slots_2048']}); decode step of "
                f"all {kv['sequences_512_256']} at 640 tokens {kv['decode_ms']:.2f} ms; peak "
                f"GPU memory {kv['peak_GiB']:.2f} GiB (planned {kv['planned_GiB']:.2f})"
            )
    if result.get("memory"):
        lines += ["", memory_check_table(result["memory"])]
    return "\n".join(lines)


ROWS = {
    "mpinfer-int8": "int8",
    "mpinfer-int8-bf16": "int8@bf16",
    "mpinfer-int8+emb8": "int8:emb8",
    "mpinfer-int4": "int4",
    "mpinfer-int4-bf16": "int4@bf16",
    "mpinfer-int4+emb8": "int4:emb8",
    "mpinfer-fp16": "none",
    "mpinfer-llm.int8": "llm.int8",
    "transformers-fp16": "hf-fp16",
    "transformers-bnb-int8": "hf-int8",
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="bloom-7b1", choices=list(SHAPES))
    p.add_argument("--rows", default=",".join(r for r in ROWS if "int4" not in r),
                   help=f"comma list of {list(ROWS)}")  # fmt: skip
    p.add_argument("--quant", default="", choices=["", "int8", "int4"],
                   help="only mpinfer's rows of this method (int4: with int8 beside it where "
                   "both fit, e.g. --shape bloom-176b --quant int4 --batches 1,8)")  # fmt: skip
    p.add_argument("--simulate-tp", type=int, default=0, help="also one BLOOM-176B rank of tp=N")
    p.add_argument("--memory", action="store_true",
                   help="also the planner against the GPU (memcheck.MEMORY_CASES)")  # fmt: skip
    p.add_argument("--gpu-mem", default="",
                   help="a GPU budget below the model: blocks stream from host memory "
                   "(offloadbench.py); e.g. 4GiB")  # fmt: skip
    p.add_argument(
        "--batches", default="", help="decode batch sizes (default 1,8,32; with --gpu-mem 1,32,128)"
    )
    p.add_argument(
        "--context",
        type=int,
        default=0,
        help="tokens before each decode step (default 512; with --gpu-mem 64)",
    )
    p.add_argument("--kv-rows", type=int, default=1,
                   help="with --gpu-mem: sequences whose KV cache the budget holds")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--no-baseline", action="store_true", help="with --gpu-mem: no accelerate")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: `mpinfer bench gpu` needs a CUDA GPU")
        return 2
    a.batches = a.batches or ("1,32,128" if a.gpu_mem else "1,8,32")
    a.context = a.context or (64 if a.gpu_mem else 512)
    if a.gpu_mem:
        result = run_offload(a)
        save_result(result, a.out or f"bench/results/offload-{a.shape}.json",
                    offload_markdown(result))  # fmt: skip
        return 0
    a.out = a.out or "bench/results/gpu.json"
    if a.quant:
        fits = a.shape != "bloom-176b"  # 176B int8 does not fit one GPU (see --gpu-mem)
        a.rows = "mpinfer-int4,mpinfer-int4-bf16" if a.quant == "int4" else ""
        a.rows = ",".join(filter(None, ["mpinfer-int8" if fits else "", a.rows]))
        a.rows = a.rows or "mpinfer-int8,mpinfer-int8-bf16"
    a.batches = [int(b) for b in a.batches.split(",")]
    a.rows = [(r, ROWS[r]) for r in a.rows.split(",")]
    result = run_gpu(a)
    save_result(result, a.out, markdown(result))
    return 0
