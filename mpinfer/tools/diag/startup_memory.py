"""Where a served process's GPU memory goes at start-up, stage by stage, beside the planner's lines
(a diagnostic for the budget issue; GPU only):

    python -m mpinfer.tools.diag.startup_memory MODEL_DIR BUDGET [--set key=value ...]
    python -m mpinfer.tools.diag.startup_memory bloom-176b 24GiB --simulate-tp 8 \
        --config configs/bloom-176b-8x24gb.toml

Starts the engine in this process as `mpinfer serve` would (one rank: load, warm-up, graphs,
sampler, fit), and after every stage prints what torch has allocated and reserved, what lives
outside the allocator (CUDA context, modules, cuBLAS/Triton workspaces) and what NVML counts for
the process; then serves a burst of long and short prompts and prints the peaks. With
`--simulate-tp N` the model is one rank of a tp-N model of that shape (tools/randmodel.py),
random weights built in place, collectives skipped: what one card of the headline config holds,
NCCL's buffers aside, and the KV pool its fit gives against the plan's.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from ...config import load_config
from ...dist import DistContext
from ...engine import engine as engine_mod
from ...engine import runner as runner_mod
from ...engine.sampling import SamplingParams
from ...model.bloom import LoadedModel
from ...model.gpumem import process_gpu_bytes
from ...model.memory import budget_bytes, plan_memory
from ...startup import runtime
from ..randmodel import build_random
from ..tiny import bloom_config, train_tokenizer

MIB = 2**20
STAGES: list[dict] = []


def record(stage: str) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used, how = process_gpu_bytes(torch.device("cuda"))
    row = {"stage": stage, "allocated": torch.cuda.memory_allocated() / MIB,
           "reserved": torch.cuda.memory_reserved() / MIB,
           "max_reserved": torch.cuda.max_memory_reserved() / MIB,
           "device_used": (total - free) / MIB, "process": used / MIB, "how": how}  # fmt: skip
    row["outside"] = row["process"] - row["reserved"]
    STAGES.append(row)
    print(f"{stage:<34}" + "".join(f"{row[k]:>10.0f}" for k in
          ("allocated", "reserved", "outside", "process")), flush=True)  # fmt: skip


def wrap(cls, name: str, label: str) -> None:
    fn = getattr(cls, name)

    def wrapped(self, *a, **k):
        record(f"before {label}")
        out = fn(self, *a, **k)
        record(f"after {label}")
        return out

    setattr(cls, name, wrapped)


def simulated_rank(shape: str, tp_size: int, cfg, ctx):
    """The runner `mpinfer serve` would make around rank 0 of a tp_size model of `shape`, built
    in place with random weights (collectives skipped) and a tokenizer of its vocabulary."""
    kind = cfg.quant.method + (":emb8" if cfg.quant.embeddings == "int8" else "")
    model, shape_, tp = build_random(shape, kind, tp_size=tp_size)
    tokdir = tempfile.mkdtemp(prefix="mpinfer-tok-")
    atexit.register(shutil.rmtree, tokdir, ignore_errors=True)
    # the tokenizer loader reads a model directory: its config.json and tokenizer, no weights
    (Path(tokdir) / "config.json").write_text(json.dumps(bloom_config(shape_, "float16")))
    train_tokenizer(Path(tokdir), 8192, 0, fill_to=shape_.vocab_size)
    loaded = LoadedModel(model, shape_, tp, model.dtype, ctx.device, tokdir)
    return runtime.runner_for(loaded, cfg, ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("budget")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--config", default=None, help="a TOML config (configs/*.toml)")
    ap.add_argument("--simulate-tp", type=int, default=0,
                    help="MODEL is a shape (tools/randmodel.py): one rank of tp=N")  # fmt: skip
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # the burst below queues twice the slots at once
    path = [] if args.simulate_tp else [f'model.path="{args.model}"']
    cfg = load_config(args.config, [*path, f'model.memory_budget="{args.budget}"',
                                    "server.max_queue=4096", *args.set])  # fmt: skip
    dev = torch.device("cuda")
    print(f"{'stage':<34}{'alloc':>10}{'reserved':>10}{'outside':>10}{'process':>10}  (MiB)")
    record("start")
    torch.ones(1, device=dev) @ torch.ones(1, 1, device=dev)
    record("context and cuBLAS")
    wrap(runner_mod.ModelRunner, "_warm_up", "runner warm-up")
    wrap(runner_mod.ModelRunner, "_capture", "graph capture")
    wrap(runner_mod.ModelRunner, "fit_cache", "fit_cache")
    wrap(engine_mod.Engine, "warm_up", "engine warm-up")
    ctx = DistContext(0, 1, 0, dev, None, None)
    engine = runtime.start(cfg, ctx, runner=simulated_rank(args.model, args.simulate_tp, cfg, ctx)
                           if args.simulate_tp else None)  # fmt: skip
    record("ready")
    loaded = engine.runner.loaded
    plan = plan_memory(loaded.shape, loaded.cfg or cfg, tp_size=args.simulate_tp or 1,
                       budget=budget_bytes(loaded.cfg or cfg, dev))  # fmt: skip
    print("\nplanner (MiB):")
    for k, v in plan.items.items():
        print(f"  {k:<32}{v / MIB:10.0f}")
    print(f"  {'total before KV':<32}{plan.fixed / MIB:10.0f}")
    r = engine.runner
    print(
        f"KV pool: {r.num_blocks} blocks x {r.cache.bytes_per_block / MIB:.2f} MiB = "
        f"{r.num_blocks * r.cache.bytes_per_block / MIB:.0f} MiB (the plan's: "
        f"{plan.kv_blocks} blocks); slots {r.slots}, buckets "
        f"{r.buckets[:3]}..{r.buckets[-1]}"
    )
    # a burst: long and short prompts, greedy and sampled
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    vocab = loaded.shape.vocab_size
    n = 0
    for i in range(2 * r.slots):
        length = [20, 1400, 300, 64][i % 4]
        length = min(length, r.max_seq - 300)
        prompt = torch.randint(4, vocab, (length,), generator=g).tolist()
        p = SamplingParams(
            max_new_tokens=64 if i % 3 else 200,
            ignore_eos=True,
            do_sample=bool(i % 2),
            top_p=0.9,
            top_k=50,
            repetition_penalty=1.1,
        )
        engine.submit(prompt, p, lambda ev: None)
        n += 1
    t0 = time.perf_counter()
    peak = [0.0]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            peak[0] = max(peak[0], process_gpu_bytes(dev)[0] / MIB)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    engine.run(until_idle=True, stop_ranks=False)
    stop.set()
    th.join()
    record("after burst")
    print(
        f"burst of {n} requests in {time.perf_counter() - t0:.1f} s; sampled peak "
        f"{peak[0]:.0f} MiB; allocator peak reserved {torch.cuda.max_memory_reserved() / MIB:.0f}"
        f" MiB; budget {budget_bytes(loaded.cfg or cfg, dev) / MIB:.0f} MiB"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"stages": STAGES, "plan": {k: v / MIB for k, v in plan.items.items()},
                       "peak_MiB": peak[0]}, f, indent=1)  # fmt: skip
    os._exit(0)


if __name__ == "__main__":
    main()
