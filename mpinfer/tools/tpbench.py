"""Decode across real tensor-parallel ranks (NCCL on GPUs, gloo on CPU), with random int8 weights
made on each rank: ms per engine decode step (the runner's captured graph on GPUs, the same
step every rank of the server runs) at several batch sizes, the measured all-reduce latency of
one decode activation, and the floor it implies (this rank's weight bytes over its copy
bandwidth, plus two all-reduces per layer). The multi-GPU counterpart of `mpinfer bench gpu
--simulate-tp`.

    torchrun --nproc-per-node 8 -m mpinfer.tools.tpbench --shape bloom-176b --out tp8.json

What is not here: correctness (the tests) and loading (loadbench.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..dist import gather_objects, init_distributed, teardown
from .randmodel import SHAPES, build_random, decode_step, fill_context, make_runner, weight_bytes
from .report import measure_ceilings


def _time_ms(fn, device, iters: int) -> float:
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def run(args) -> dict | None:
    ctx = init_distributed(timeout_s=300)
    try:
        shape = SHAPES[args.shape]
        on_gpu = ctx.device.type == "cuda"
        kind = "int8:emb8" if args.embeddings == "int8" else "int8"
        group = ctx.compute_group if ctx.world_size > 1 else None
        model, shape, tp = build_random(args.shape, kind, tp_size=ctx.world_size,
                                        tp_rank=ctx.rank, group=group, seed=ctx.rank,
                                        dtype=torch.float16 if on_gpu else torch.float32,
                                        device=str(ctx.device))  # fmt: skip
        wbytes = weight_bytes(model)
        result = {
            "shape": args.shape,
            "tp": ctx.world_size,
            "device": str(ctx.device),
            "weight_GB_per_rank": wbytes / 1e9,
            "decode_ms": {},
        }
        x = torch.ones(1, shape.hidden_size, dtype=model.dtype, device=ctx.device)
        ar_ms = _time_ms(lambda: dist.all_reduce(x, group=ctx.compute_group), ctx.device, 50)
        result["all_reduce_ms"] = ar_ms
        if on_gpu:
            bw = measure_ceilings()["copy_bandwidth_GBps"] * 1e9
            result["floor_ms"] = wbytes / bw * 1e3 + 2 * shape.n_layer * ar_ms
        # NCCL collectives are captured in the graphs too; every rank captures the same ones.
        runner = make_runner(model, shape, tp, slots=max(args.batches),
                             max_seq=args.context + 16, ctx=ctx)  # fmt: skip
        fill_context(runner, max(args.batches), args.context)
        for B in args.batches:
            step = decode_step(B, args.context)
            result["decode_ms"][B] = _time_ms(lambda: runner.execute(step), ctx.device,
                                              20 if on_gpu else 5)  # fmt: skip
        if on_gpu:
            result["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        result["all_reduce_share_b1"] = (
            2 * shape.n_layer * ar_ms / result["decode_ms"][args.batches[0]]
        )
        every = gather_objects(result, ctx)
        return every[0] | {"per_rank_peak_GB": [r.get("peak_GB") for r in every]} if every else None
    finally:
        teardown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mpinfer.tools.tpbench", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="bloom-176b", choices=list(SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--embeddings", default="int8", choices=("int8", "none"))
    p.add_argument("--out", default="bench/results/tp.json")
    a = p.parse_args(argv)
    result = run(a)
    if result is not None:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
