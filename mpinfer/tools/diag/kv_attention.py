"""The decode attention over an fp16 and an int8 KV cache, side by side (GPU only):

    python -m mpinfer.tools.diag.kv_attention [--modules attention,OTHER] [--out FILE]

For bloom-7b1 (32 heads) and one BLOOM-176B tp-8 rank (14 heads), batches of 1, 32 and 64 rows
at 512 and 2,048 tokens of history, over a block-table cache of shuffled 16-token blocks (a
served pool's layout): both launches of `decode_attention` as the step runs them (the policy's
splits, the default tile), in a CUDA graph cycling through enough caches to miss the L2. Per
case: microseconds, the cache bytes read (keys and values, with an int8 cache's scales) and
their rate. --modules names kernel modules of mpinfer.model.kernels to compare (an older copy
of attention.py saved under another name, for a before/after in one process).
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

from ..report import graph_time_us, l2_copies, md_table

CASES = [("7b1", 32), ("176b/8", 14)]
BLOCK = 16


def case(mod, heads: int, batch: int, context: int, int8: bool, l2_bytes: int) -> dict:
    hd = 128
    blocks_per_row = -(-(context + 1) // BLOCK)
    n_blocks = batch * blocks_per_row
    per_token = 2 * heads * hd * (1 if int8 else 2) + (2 * heads * 4 if int8 else 0)
    read = batch * context * per_token
    copies = l2_copies(read, l2_bytes)
    dims = (n_blocks, heads, BLOCK, hd)
    caches = []
    for _ in range(copies):
        if int8:
            k, v = (torch.randint(-127, 128, dims, dtype=torch.int8, device="cuda") for _ in "kv")
            s = tuple(torch.rand(dims[:3], device="cuda") / 127 for _ in "kv")
        else:
            k, v = (torch.randn(dims, dtype=torch.float16, device="cuda") for _ in "kv")
            s = None
        caches.append((k, v, s))
    tables = torch.randperm(n_blocks, device="cuda").view(batch, blocks_per_row)
    qkv = torch.randn(batch, heads * 3 * hd, dtype=torch.float16, device="cuda")
    slots = torch.arange(batch, device="cuda")
    pos = torch.full((batch,), context, device="cuda")
    vf = torch.zeros(batch, dtype=torch.long, device="cuda")
    slopes = torch.rand(heads, device="cuda")
    out = torch.empty(batch, heads * hd, dtype=torch.float16, device="cuda")

    def call(i):
        k, v, s = caches[i]
        mod.decode_attention(qkv, k, v, slots, pos, vf, slopes, tables, out=out, scales=s)

    us = graph_time_us(call, copies, calls=max(copies, 12), reps=5)
    return {"heads": heads, "batch": batch, "context": context,
            "kv": "int8" if int8 else "fp16", "us": us, "bytes": read,
            "GBps": read / us / 1e3}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", default="attention", help="kernel modules, comma-separated")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, table = [], []
    for name in a.modules.split(","):
        mod = importlib.import_module(f"mpinfer.model.kernels.{name}")
        for shape, heads in CASES:
            for batch in (1, 32, 64):
                for context in (512, 2048):
                    pair = [case(mod, heads, batch, context, q, l2) for q in (False, True)]
                    for r in pair:
                        r.update(module=name, shape=shape)
                    rows += pair
                    f, q = pair
                    table.append([name, shape, batch, context, f"{f['us']:.1f}",
                                  f"{f['GBps']:.0f}", f"{q['us']:.1f}", f"{q['GBps']:.0f}",
                                  f"{q['us'] / f['us']:.2f}"])  # fmt: skip
                    torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}: decode attention (both launches), shuffled blocks of "
          f"{BLOCK}, CUDA graph, cache from HBM\n")  # fmt: skip
    print(md_table(["kernels", "shape", "batch", "context", "fp16 us", "fp16 GB/s", "int8 us",
                    "int8 GB/s", "int8 / fp16"], table))  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
