"""`mpinfer bench gpu --gpu-mem BUDGET`: a model larger than the budget, its blocks streamed from
host memory (model/offload.py), beside the floor those copies set and the baselines, in one run.

For a random BLOOM of a given shape (no checkpoint: resident weights made on the GPU, offloaded
ones in the page-locked host arena, the same random values either way), in this order:
- the host-to-GPU copy speed: one large copy, and one block tensor by tensor (the transfer unit);
- the planner's offload plan for the budget (model.offload_blocks = -1), with the KV cache of
  `kv_rows` sequences counted out of the budget (the KV of larger batches is allocated beyond
  it, as accelerate's max_memory counts weights alone);
- the engine's decode step (ModelRunner.execute) at each batch after `context` tokens, with
  offload, beside the transfer floor (offloaded bytes / measured copy speed); ring depths 1-3;
- logits with offload against a reference that copies each offloaded block in synchronously
  and runs it (no side stream, no ring, no events), and, where the model fits the GPU, against
  the same weights all resident; and the step without offload, graphed and eager;
- transformers + accelerate (fp16, `dispatch_model` with the same GPU budget), where it fits.
What is not here: the planner itself (model/offloadplan.py), the served speed (servegpu.py).
"""

from __future__ import annotations

import gc
import json
import time

import torch

from ..checkpoint.loader import assign_tensor, build_meta_model, finish_model
from ..config import load_config, parse_bytes
from ..engine.step import Prefill, Step
from ..extras import require
from ..model.attention import KVCache
from ..model.layers import TPGroup
from ..model.offload import HostArena, Offload
from ..model.offloadplan import plan_offload
from .randmodel import SHAPES, decode_step, free_gpu, make_runner, randomize_model
from .report import cuda_time, machine, md_table, measure_ceilings

GIB = 2**30
# The benchmark runs on a GPU; on a CPU (tests/test_offload.py) the same code with host-to-host
# copies and wall-clock timing checks the plan, the reference and the logits.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEV.type == "cuda"


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if ON_GPU:
        free_gpu()


def timed(fn, *, iters: int, warmup: int = 1) -> float:
    """Mean ms of fn(): CUDA events on a GPU, the wall clock on a CPU."""
    if ON_GPU:
        return cuda_time(fn, iters=iters, warmup=warmup)
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def copy_speed(block_params: list[torch.Tensor] | None = None, nbytes: int = GIB) -> dict:
    """GB/s of page-locked host-to-GPU copies: one `nbytes` copy, and one block's tensors."""
    arena = HostArena(nbytes, pin=ON_GPU)
    src = arena.take((nbytes,), torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    out = {"one_copy_GBps": nbytes / timed(lambda: dst.copy_(src, non_blocking=True), iters=10)
           / 1e6}  # fmt: skip
    if block_params:
        ring = [torch.empty_like(p, device=DEV) for p in block_params]
        n = sum(p.numel() * p.element_size() for p in block_params)

        def copy_block():
            for d, s in zip(ring, block_params):
                d.copy_(s, non_blocking=True)

        out["block_GBps"] = n / timed(copy_block, iters=10) / 1e6
    arena.close()
    return out


def build_offloaded(shape_name: str, budget: int, *, kv_tokens: int, context: int,
                    kv_int8: bool, depth: int = 2, seed: int = 0):  # fmt: skip
    """The int8 model mpinfer would load with model.offload_blocks = -1 under `budget` less the
    KV cache of `kv_tokens`, built in place: resident weights on the GPU, offloaded ones in the
    host arena. (model, shape, tp, plan)."""
    shape = SHAPES[shape_name]
    cfg = bench_config(context, kv_int8, depth)
    kv_bytes = kv_tokens * kv_token_bytes(shape, kv_int8)
    off = plan_offload(shape, cfg, tp_size=1, budget=budget - kv_bytes)
    tp = TPGroup(0, 1, None)
    model = build_meta_model(shape, tp, cfg, torch.float16)
    blocks = set(off.offloaded) if off else set()
    host = [(n, p) for n, p in model.named_parameters()
            if n.startswith("h.") and int(n.split(".")[1]) in blocks]  # fmt: skip
    arena = None
    if host:
        arena = HostArena(HostArena.size_for([(tuple(p.shape), p.dtype) for _, p in host]),
                          pin=ON_GPU)  # fmt: skip
    names = {n for n, _ in host}
    for name, p in list(model.named_parameters()):
        t = arena.take(p.shape, p.dtype) if name in names else torch.empty_like(p, device=DEV)
        assign_tensor(model, name, t)
    randomize_model(model, seed=seed, finish=False)
    finish_model(model, DEV, off, arena)
    return model, shape, tp, off


def bench_config(context: int, kv_int8: bool, depth: int = 2):
    """The settings the benchmark plans with: int8 weights, offload_blocks = -1, sequences of
    context + 64 tokens."""
    kv = "int8" if kv_int8 else "auto"
    return load_config(None, ['quant.method="int8"', "model.offload_blocks=-1",
                              f"model.offload_depth={depth}", f"server.max_seq_len={context + 64}",
                              f'server.kv_cache_dtype="{kv}"'])  # fmt: skip


def kv_token_bytes(shape, kv_int8: bool) -> int:
    return KVCache.bytes_per_token(shape, 1, torch.float16, quantized=kv_int8)


class SyncReference:
    """The reference for the logits check: each offloaded block copied into one GPU module and
    synchronized before it runs; the offload protocol (start_step, block, done) and nothing
    else."""

    def __init__(self, off: Offload):
        self.off = off
        self.module = off.ring[0]
        self.params = off.ring_params[0]

    def __contains__(self, b: int) -> bool:
        return b in self.off

    def start_step(self) -> None:
        sync()

    def block(self, b: int):
        for dst, src in zip(self.params, self.off.host[b]):
            dst.data.copy_(src.data)
        sync()
        return self.module

    def done(self, b: int) -> None:
        sync()


def logits_of(model, shape, tp, prompt: list[int]) -> torch.Tensor:
    """The last-position logits of `prompt` and those of one decode step after it (fp32)."""
    runner = make_runner(model, shape, tp, slots=1, max_seq=len(prompt) + 8, cuda_graphs=False,
                         max_prefill_tokens=32)  # fmt: skip
    first = runner.execute(Step(prefills=(Prefill(0, 0, tuple(prompt), sample=True),)))
    runner.next_tokens[0] = int(first[0].argmax())
    second = runner.execute(decode_step(1, len(prompt)))
    return torch.cat([first, second]).float()


def fill(runner, rows: int, context: int, per_step: int) -> None:
    """`context` random tokens into each of the first `rows` rows, `per_step` rows a step (each
    step with offload costs a full pass of copies)."""
    g = torch.Generator().manual_seed(1)
    vocab = runner.loaded.shape.vocab_size
    for first in range(0, rows, per_step):
        pre = tuple(Prefill(r, 0, tuple(torch.randint(4, vocab, (context,), generator=g).tolist()))
                    for r in range(first, min(rows, first + per_step)))  # fmt: skip
        runner.execute(Step(prefills=pre))


def time_steps(model, shape, tp, batches, context, *, kv_int8, graphs, iters) -> dict:
    most = max(batches)
    per_step = max(1, min(most, 2048 // context))
    runner = make_runner(model, shape, tp, slots=most, max_seq=context + 16, cuda_graphs=graphs,
                         max_prefill_tokens=per_step * context, kv_int8=kv_int8)  # fmt: skip
    fill(runner, most, context, per_step)
    out = {}
    for b in batches:
        step = decode_step(b, context)
        out[b] = timed(lambda: runner.execute(step), iters=iters)
    return out


def accelerate_baseline(shape_name: str, budget: int, batches, context: int) -> dict:
    """transformers fp16 with accelerate placing modules under `budget` on the GPU and the rest
    in host memory (`dispatch_model`), what `from_pretrained(device_map="auto", max_memory=...)`
    does: ms per decode step after `context` tokens."""
    transformers, accelerate = require("transformers"), require("accelerate")
    shape = SHAPES[shape_name]
    cfg = transformers.BloomConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                                   n_layer=shape.n_layer, n_head=shape.n_head)  # fmt: skip
    with torch.device("cuda"):
        model = transformers.BloomForCausalLM(cfg).to(torch.float16).eval()
    model.to("cpu")
    dmap = accelerate.infer_auto_device_map(
        model, max_memory={0: budget, "cpu": 400 * GIB},
        no_split_module_classes=model._no_split_modules, dtype=torch.float16)  # fmt: skip
    model = accelerate.dispatch_model(model, device_map=dmap)
    on_gpu = sum(1 for d in dmap.values() if d == 0)
    out = {"modules_on_gpu": on_gpu, "modules": len(dmap), "decode_ms": {}}
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(4, shape.vocab_size, (b, context), device="cuda")
            past = model(input_ids=ids, attention_mask=torch.ones_like(ids)).past_key_values
            steps, t0 = 3, 0.0
            for i in range(steps + 1):
                if i == 1:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                mask = torch.ones((b, context + i + 1), dtype=torch.long, device="cuda")
                past = model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=past,
                             use_cache=True).past_key_values  # fmt: skip
            torch.cuda.synchronize()
            out["decode_ms"][b] = (time.perf_counter() - t0) / steps * 1e3
            del past
    del model
    return out


def run_offload(a) -> dict:
    budget = parse_bytes(a.gpu_mem, "--gpu-mem")
    batches = tuple(int(b) for b in a.batches.split(","))
    ctx, big = a.context, a.shape == "bloom-176b"
    iters = 3 if big else 10
    result = {"machine": machine(), "shape": a.shape, "budget_GiB": budget / GIB,
              "context": ctx, "batches": batches, "kv_cache_dtype": a.kv_cache_dtype}  # fmt: skip
    kv_int8 = a.kv_cache_dtype == "int8"
    t0 = time.perf_counter()
    model, shape, tp, off = build_offloaded(a.shape, budget, kv_tokens=a.kv_rows * (ctx + 16),
                                            context=ctx, kv_int8=kv_int8)  # fmt: skip
    result["build_s"] = time.perf_counter() - t0
    o = model.offload
    result["plan"] = {"offloaded": list(off.offloaded), "of": shape.n_layer,
                      "depth": off.depth, "host_GiB": off.host_bytes / GIB,
                      "block_MiB": off.block_bytes / 2**20}  # fmt: skip
    result["copy"] = copy_speed(o.host[o.order[0]], GIB if ON_GPU else 2**24)
    gbps = result["copy"]["one_copy_GBps"]
    result["floor_ms"] = off.copy_ms(gbps)
    if ON_GPU:  # the planner's estimate (offloadplan.OffloadPlan) with this machine's figures
        ceil = measure_ceilings()
        tbps, tflops = ceil["copy_bandwidth_GBps"] / 1e3, ceil["bf16_matmul_TFLOPs"]
        result["ceilings"] = ceil
        result["predicted_ms"] = {b: off.predict_ms(b, gbps, tbps, tflops) for b in batches}
        result["compute_bound_from"] = off.compute_bound_from(gbps, tbps, tflops)
    print(json.dumps(result), flush=True)
    result["offload_ms"] = time_steps(model, shape, tp, batches, ctx, kv_int8=kv_int8,
                                      graphs=False, iters=iters)  # fmt: skip
    result["gpu_allocated_GiB"] = torch.cuda.max_memory_allocated() / GIB if ON_GPU else 0.0
    print(json.dumps(result["offload_ms"]), flush=True)
    prompt = torch.randint(4, shape.vocab_size, (16,), generator=torch.Generator().manual_seed(2))
    got = logits_of(model, shape, tp, prompt.tolist())
    model.offload = SyncReference(o)
    ref = logits_of(model, shape, tp, prompt.tolist())
    model.offload = o
    result["vs_sync_reference"] = logit_diff(got, ref)
    if not big:  # ring depths at batch 1 (a depth-3 ring takes one more block's memory)
        result["depth_ms"] = {}
        for d in (1, 2, 3):
            model.offload = Offload(model.h, list(off.offloaded), d, DEV, o.arena)
            result["depth_ms"][d] = time_steps(model, shape, tp, (1,), ctx, kv_int8=kv_int8,
                                               graphs=False, iters=iters)[1]  # fmt: skip
        model.offload = None
        del o
    print(json.dumps(result), flush=True)
    del model
    release()
    if not big:  # the same weights all on the GPU: the no-offload step and the logits
        full, _, _, _ = build_offloaded(a.shape, 1 << 50, kv_tokens=0, context=ctx,
                                        kv_int8=kv_int8)  # fmt: skip
        result["vs_all_resident"] = logit_diff(got, logits_of(full, shape, tp, prompt.tolist()))
        result["resident_ms"] = time_steps(full, shape, tp, batches, ctx, kv_int8=kv_int8,
                                           graphs=True, iters=30)  # fmt: skip
        result["resident_eager_ms"] = time_steps(full, shape, tp, batches, ctx, kv_int8=kv_int8,
                                                 graphs=False, iters=10)  # fmt: skip
        del full
        release()
        if not a.no_baseline:
            result["accelerate"] = accelerate_baseline(a.shape, budget, batches, ctx)
    return result


def logit_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"max_abs": float((a - b).abs().max()), "max_logit": float(b.abs().max()),
            "same_argmax": bool((a.argmax(-1) == b.argmax(-1)).all())}  # fmt: skip


def markdown(r: dict) -> str:
    p, c = r["plan"], r["copy"]
    lines = [
        f"{r['machine'].get('gpu')}: {r['shape']} int8, GPU budget {r['budget_GiB']:.1f} GiB, "
        f"context {r['context']}, KV cache {r['kv_cache_dtype']}",
        f"- plan: {len(p['offloaded'])} of {p['of']} blocks in host memory "
        f"({p['host_GiB']:.2f} GiB page-locked, {p['block_MiB']:.0f} MiB a block), ring of "
        f"{p['depth']}; peak GPU memory allocated {r['gpu_allocated_GiB']:.2f} GiB",
        f"- host-to-GPU: {c['one_copy_GBps']:.1f} GB/s one 1 GiB copy, "
        f"{c.get('block_GBps', 0):.1f} GB/s one block tensor by tensor; transfer floor "
        f"{r['floor_ms']:.1f} ms a step",
        f"- logits vs the synchronous reference: max |diff| {r['vs_sync_reference']['max_abs']:.3g}"
        f" (logits up to {r['vs_sync_reference']['max_logit']:.1f})",
    ]
    if "vs_all_resident" in r:
        lines.append(f"- logits vs all resident: max |diff| {r['vs_all_resident']['max_abs']:.3g}")
    if "depth_ms" in r:
        lines.append("- batch 1 by ring depth: " + ", ".join(
            f"{d}: {ms:.1f} ms" for d, ms in r["depth_ms"].items()))  # fmt: skip
    header = ["batch", "offload ms", "planner's estimate ms", "floor ms", "offload / floor",
              "no offload ms (graph)", "no offload ms (eager)", "offload / max(floor, no offload)",
              "tok/s", "accelerate ms", "x accelerate"]  # fmt: skip
    rows = []
    for b, ms in r["offload_ms"].items():
        res = r.get("resident_ms", {}).get(b)
        eager = r.get("resident_eager_ms", {}).get(b)
        acc = r.get("accelerate", {}).get("decode_ms", {}).get(b)
        est = r.get("predicted_ms", {}).get(b)
        rows.append([b, f"{ms:.1f}", f"{est:.1f}" if est else "-", f"{r['floor_ms']:.1f}",
                     f"{ms / r['floor_ms']:.2f}",
                     f"{res:.2f}" if res else "-", f"{eager:.2f}" if eager else "-",
                     f"{ms / max(r['floor_ms'], res or 0):.2f}", f"{b / ms * 1e3:.1f}",
                     f"{acc:.0f}" if acc else "-", f"{acc / ms:.1f}" if acc else "-"])  # fmt: skip
    if "compute_bound_from" in r:
        lines.append(f"- the planner puts the step compute-bound from batch "
                     f"{r['compute_bound_from']}")  # fmt: skip
    if "accelerate" in r:
        a = r["accelerate"]
        lines.append(f"- transformers + accelerate fp16: {a['modules_on_gpu']} of {a['modules']} "
                     "modules on the GPU")  # fmt: skip
    return "\n".join(lines + ["", md_table(header, rows)])
