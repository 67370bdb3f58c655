"""Decode across real tensor-parallel ranks (NCCL on GPUs, gloo on CPU), with random int8 weights
made on each rank: ms per step at several batch sizes, the measured all-reduce latency of one
decode activation, and the floor it implies (this rank's weight bytes over its copy bandwidth,
plus two all-reduces per layer). The multi-GPU counterpart of `mpinfer bench gpu --simulate-tp`.

    torchrun --nproc-per-node 8 -m mpinfer.tpbench --shape bloom-176b --out bench/results/tp8.json

What is not here: correctness (the tests) and loading (loadbench.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist


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
    from .bench import SHAPES, measure_ceilings, randomize_model, weight_bytes
    from .config import load_config
    from .dist import gather_objects, init_distributed, teardown
    from .layers import TPGroup
    from .loader import build_meta_model
    from .model import DecodeGraph, KVCache
    from .plan import BloomShape

    ctx = init_distributed(timeout_s=300)
    try:
        shape = BloomShape(**SHAPES[args.shape])
        dtype = torch.float16 if ctx.device.type == "cuda" else torch.float32
        cfg = load_config(None, ['quant.method="int8"', f'quant.embeddings="{args.embeddings}"'])
        tp = TPGroup(ctx.rank, ctx.world_size, ctx.compute_group if ctx.world_size > 1 else None)
        model = build_meta_model(shape, tp, cfg, dtype).to_empty(device=ctx.device)
        randomize_model(model, seed=ctx.rank)
        wbytes = weight_bytes(model)
        result = {
            "shape": args.shape,
            "tp": ctx.world_size,
            "device": str(ctx.device),
            "weight_GB_per_rank": wbytes / 1e9,
            "decode_ms": {},
        }
        x = torch.ones(1, shape.hidden_size, dtype=dtype, device=ctx.device)
        ar_ms = _time_ms(lambda: dist.all_reduce(x, group=ctx.compute_group), ctx.device, 50)
        result["all_reduce_ms"] = ar_ms
        if ctx.device.type == "cuda":
            bw = measure_ceilings()["copy_bandwidth_GBps"] * 1e9
            result["floor_ms"] = wbytes / bw * 1e3 + 2 * shape.n_layer * ar_ms
        for B in args.batches:
            cache = KVCache.allocate(
                shape,
                ctx.world_size,
                slots=B,
                max_seq=args.context + 16,
                dtype=dtype,
                device=ctx.device,
            )
            ids = torch.randint(4, shape.vocab_size, (B, args.context), device=ctx.device)
            z = torch.zeros(B, dtype=torch.long, device=ctx.device)
            model(ids, cache, slots=slice(0, B), start_pos=z, valid_from=z, kv_len=args.context)
            token, pos = ids[:, -1:], z + args.context
            if ctx.device.type == "cuda":  # NCCL collectives are captured in the graph too
                graph = DecodeGraph(model, cache, B)
                ms = _time_ms(lambda: graph(token, pos, z), ctx.device, 20)
            else:
                ms = _time_ms(
                    lambda: model(
                        token,
                        cache,
                        slots=slice(0, B),
                        start_pos=pos,
                        valid_from=z,
                        kv_len=args.context + 1,
                    ),
                    ctx.device,
                    5,
                )
            result["decode_ms"][B] = ms
        if ctx.device.type == "cuda":
            result["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        result["all_reduce_share_b1"] = (
            2 * shape.n_layer * ar_ms / result["decode_ms"][args.batches[0]]
        )
        every = gather_objects(result, ctx)
        return every[0] | {"per_rank_peak_GB": [r.get("peak_GB") for r in every]} if every else None
    finally:
        teardown()


def main(argv: list[str] | None = None) -> int:
    from .bench import SHAPES

    p = argparse.ArgumentParser(prog="mpinfer.tpbench", description=__doc__.split("\n")[0])
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
