"""`mpinfer bench gpu`: decode and prefill speed on one GPU, side by side with the baselines.

One run measures, in this order: the device-to-device copy bandwidth and the bf16 matmul rate of
this GPU (the ceilings), then for a random BLOOM of a given shape (weights made on the GPU, no
checkpoint) mpinfer int8, fp16 and llm.int8, transformers fp16 and transformers + bitsandbytes
8-bit: ms per decode step at batch 1, 8 and 32 after a context of 512, prefill time for 512
and 2048 tokens, peak GPU memory, and each row's floor (weight bytes / copy bandwidth).
`--simulate-tp 8` adds one rank's shard of BLOOM-176B at tp 8 (collectives skipped and counted).
Writes JSON and a markdown table under bench/results/. What is not here: CPU benchmarks
(loadbench.py) and the server's load test (servebench.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import time
from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(vocab_size=1024, hidden_size=64, n_layer=2, n_head=4),  # CPU smoke runs
    "bloom-560m": dict(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16),
    "bloom-7b1": dict(vocab_size=250880, hidden_size=4096, n_layer=30, n_head=32),
    "bloom-176b": dict(vocab_size=250880, hidden_size=14336, n_layer=70, n_head=112),
}


def randomize_model(model, *, seed: int = 0) -> None:
    """Fill a model (already on its device, storage uninitialized) with random weights and run
    the after-load hooks: int8 rows with scales giving std ~1/sqrt(fan_in), unit LayerNorms."""
    from .loader import finish_model

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.int8:
                p.copy_(torch.randint(-127, 128, p.shape, generator=g, device=p.device))
            elif name.endswith("weight_scale"):
                fan_in = model.get_parameter(name[: -len("_scale")]).shape[1]
                p.fill_(1.7 / math.sqrt(fan_in) / 127)
            elif "layernorm.weight" in name or name == "ln_f.weight":
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[1]), generator=g)
    finish_model(model, next(model.parameters()).device)


def build_random(
    shape_name: str, kind: str, *, tp_size: int = 1, dtype=torch.float16, device: str = "cuda"
):
    """kind: a quant method, with ":emb8" for int8 embeddings too (e.g. "int8:emb8") and "@bf16"
    for bf16 activations (e.g. "int8@bf16")."""
    from .config import load_config
    from .layers import TPGroup
    from .loader import build_meta_model
    from .plan import BloomShape

    kind, _, act = kind.partition("@")
    if act:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[act]
    method, _, emb = kind.partition(":")
    shape = BloomShape(**SHAPES[shape_name])
    embeddings = "int8" if emb == "emb8" else "none"
    cfg = load_config(None, [f'quant.method="{method}"', f'quant.embeddings="{embeddings}"'])
    tp = TPGroup(0, tp_size)  # tp_size > 1 without a group: one simulated rank
    model = build_meta_model(shape, tp, cfg, dtype).to_empty(device=device)
    randomize_model(model)
    return model, shape, tp


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cuda_time(fn, *, iters: int, warmup: int = 3) -> float:
    """Mean milliseconds of fn() over iters runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure_ceilings() -> dict:
    n = 1 << 30  # 1 GiB each way: far past the 60 MB L2
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), iters=20)
    bw = 2 * n / (ms / 1e3)  # bytes read + written
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = cuda_time(lambda: x @ y, iters=10)
    return {"copy_bandwidth_GBps": bw / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / (mm / 1e3) / 1e12}


def profile_step(step, iters: int = 5) -> list[dict]:
    """Per-kernel GPU time of one (eager) decode step: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

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
    from .model import DecodeGraph, KVCache

    out, dev = {"decode_ms": {}, "prefill_ms": {}}, "cuda"
    for B in batches:
        cache = KVCache.allocate(
            shape, tp.tp_size, slots=B, max_seq=context + 64, dtype=model.dtype, device=dev
        )
        ids = torch.randint(4, shape.vocab_size, (B, context), device=dev)
        zeros = torch.zeros(B, dtype=torch.long, device=dev)
        model(ids, cache, slots=slice(0, B), start_pos=zeros, valid_from=zeros, kv_len=context)
        token = ids[:, -1:]
        pos = zeros + context
        if use_graph:
            step = DecodeGraph(model, cache, B)
            ms = cuda_time(lambda: step(token, pos, zeros), iters=30)
        else:
            ms = cuda_time(
                lambda: model(
                    token,
                    cache,
                    slots=slice(0, B),
                    start_pos=pos,
                    valid_from=zeros,
                    kv_len=context + 1,
                ),
                iters=10,
            )
        out["decode_ms"][B] = ms
        if B in (1, 32) and profile:
            out[f"kernels_b{B}"] = profile_step(
                lambda: model(token, cache, slots=slice(0, B), start_pos=pos, valid_from=zeros,
                              kv_len=cache.max_seq)
            )  # fmt: skip
    for T in prefill_lens:
        cache = KVCache.allocate(
            shape, tp.tp_size, slots=1, max_seq=T, dtype=model.dtype, device=dev
        )
        ids = torch.randint(4, shape.vocab_size, (1, T), device=dev)
        z = torch.zeros(1, dtype=torch.long, device=dev)
        out["prefill_ms"][T] = cuda_time(
            lambda: model(ids, cache, slots=slice(0, 1), start_pos=z, valid_from=z, kv_len=T),
            iters=3,
            warmup=1,
        )
    return out


def build_hf(shape_name: str, *, int8: bool):
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(**SHAPES[shape_name])
    with torch.device("cuda"):
        model = BloomForCausalLM(cfg).to(torch.float16).eval()
    if int8:  # what load_in_8bit does: every block Linear becomes a bnb Linear8bitLt
        import bitsandbytes as bnb

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
            lambda: model(input_ids=ids, logits_to_keep=1), iters=3, warmup=1
        )
    return out


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_gpu(args) -> dict:
    ceil = measure_ceilings()
    bw = ceil["copy_bandwidth_GBps"] * 1e9
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    batches, ctx, pre = (1, 8, 32), 512, (512, 2048)
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
                SHAPES[args.shape]["vocab_size"],
                batches=batches,
                context=ctx,
                prefill_lens=pre,
                steps=20 if kind == "hf-int8" else 40,
            )
        else:
            model, shape, tp = build_random(args.shape, kind)
            block_params = sum(p.numel() for p in model.h.parameters() if p.dtype != torch.float32)
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
        from .memory import MEMORY_CASES, memory_check

        memory = [memory_check(*case) for case in MEMORY_CASES]
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
    from .model import KVCache

    free_gpu()
    model, shape, tp = build_random("bloom-176b", f"int8:emb8@{dtype}", tp_size=tp_size)
    wbytes = weight_bytes(model)
    res = bench_mpinfer(model, shape, tp, batches=(1, 8, 32), context=512, prefill_lens=(),
                        profile=True)  # fmt: skip
    step_ms = res["decode_ms"][1]
    tp.skipped.clear()
    free_gpu()  # the peak below: weights + a 2048-token cache + one step's activations
    cache = KVCache.allocate(
        shape, tp_size, slots=1, max_seq=2048, dtype=model.dtype, device="cuda"
    )
    z = torch.zeros(1, dtype=torch.long, device="cuda")
    model(
        torch.ones((1, 1), dtype=torch.long, device="cuda"),
        cache,
        slots=slice(0, 1),
        start_pos=z,
        valid_from=z,
        kv_len=1,
    )
    return {
        "tp_size": tp_size,
        "activations": dtype,
        "weight_GB": wbytes / 1e9,
        "floor_ms": wbytes / bw * 1e3,
        "decode_ms": res["decode_ms"],
        "ratio_to_floor": step_ms / (wbytes / bw * 1e3),
        "collectives_per_step_skipped": dict(tp.skipped),
        **{k: v for k, v in res.items() if k.startswith("kernels")},
        "peak_GB_with_2048_token_cache": torch.cuda.max_memory_allocated() / 1e9,
    }


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table: the header cells, then one line per row of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save_result(result: dict, out: str, table: str) -> None:
    """Every benchmark's ending: the JSON at `out`, the markdown table beside it, the table on
    stdout."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(table + "\n")
    print(table)


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_GB=p.total_memory / 1e9, sms=p.multi_processor_count)
    return info


def markdown(result: dict) -> str:
    c = result["ceilings"]
    header = ["row", "weights GB", "floor ms", "decode ms b=1", "b=8", "b=32", "b=1 / floor",
              "prefill 512 ms", "prefill 2048 ms", "2048 TFLOP/s", "peak GB"]  # fmt: skip
    rows = []
    for r in result["rows"]:
        d, p = r["decode_ms"], r["prefill_ms"]
        rows.append([r["row"], f"{r['weight_GB']:.2f}", f"{r['floor_ms']:.2f}", f"{d[1]:.2f}",
                     f"{d[8]:.2f}", f"{d[32]:.2f}", f"{d[1] / r['floor_ms']:.2f}", f"{p[512]:.1f}",
                     f"{p[2048]:.1f}", f"{r['prefill_TFLOPs'][2048]:.0f}",
                     f"{r['peak_GB']:.1f}"])  # fmt: skip
    lines = [
        f"{result['machine'].get('gpu', 'cpu')}: copy {c['copy_bandwidth_GBps'] / 1e3:.2f} TB/s, "
        f"bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s; shape {result['shape']}, context 512",
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
    if result.get("memory"):
        from .memory import memory_check_table

        lines += ["", memory_check_table(result["memory"])]
    return "\n".join(lines)


ROWS = {
    "mpinfer-int8": "int8",
    "mpinfer-int8-bf16": "int8@bf16",
    "mpinfer-int8+emb8": "int8:emb8",
    "mpinfer-fp16": "none",
    "mpinfer-llm.int8": "llm.int8",
    "transformers-fp16": "hf-fp16",
    "transformers-bnb-int8": "hf-int8",
}


def bench_main(argv: list[str]) -> int:
    if argv and argv[0] == "kernels":
        from . import kernelbench

        return kernelbench.main(argv)
    if argv and argv[0] != "gpu" and argv[0] not in ("-h", "--help"):
        from . import loadbench  # the CPU benchmarks

        return loadbench.main(argv)
    p = argparse.ArgumentParser(prog="mpinfer bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["gpu"])
    p.add_argument("--shape", default="bloom-7b1", choices=list(SHAPES))
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {list(ROWS)}")
    p.add_argument("--simulate-tp", type=int, default=0, help="also one BLOOM-176B rank of tp=N")
    p.add_argument("--memory", action="store_true",
                   help="also the planner against the GPU (memory.MEMORY_CASES)")  # fmt: skip
    p.add_argument("--out", default="bench/results/gpu.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: `mpinfer bench gpu` needs a CUDA GPU")
        return 2
    a.rows = [(r, ROWS[r]) for r in a.rows.split(",")]
    result = run_gpu(a)
    save_result(result, a.out, markdown(result))
    return 0
