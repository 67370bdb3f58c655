"""The decode attention over an fp16 and an int8 KV cache, side by side (GPU only):

    python -m mpinfer.tools.diag.kv_attention [--modules attention,OTHER] [--mixed] [--out FILE]

For bloom-7b1 (32 heads) and one BLOOM-176B tp-8 rank (14 heads), batches of 1, 32 and 64 rows
at 512 and 2,048 tokens of history, over a block-table cache of shuffled 16-token blocks (a
served pool's layout): both launches of `decode_attention` as the step runs them (the policy's
splits, the default tile), in a CUDA graph cycling through enough caches to miss the L2. Per
case: microseconds, the cache bytes read (keys and values, with an int8 cache's scales) and
their rate. --modules names kernel modules of mpinfer.model.kernels to compare (an older copy
of attention.py saved under another name, for a before/after in one process), each with
options after colons: `l64` (keys a tile), `w4` (warps a program), `biased` or `exact` (the int8
cache's route; biased is the default), e.g. `attention,attention:exact,attention:l64:w4`.
--mixed: a decode batch of the unique mix's mixed histories, timed at every split count.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json

import torch

from ...model.kernels.tuning import attention_splits, sm_count
from ..report import graph_time_us, l2_copies, md_table

CASES = [("7b1", 32), ("176b/8", 14)]
BLOCK = 16


def attention_fn(spec: str):
    """'MODULE[:lN][:wN][:biased|:exact]' -> its decode_attention with N keys a tile, N warps
    a program, the int8 cache's biased or exact route."""
    name, *opts = spec.split(":")
    kw = {}
    for o in opts:
        if o in ("biased", "exact"):
            kw["biased"] = o == "biased"
        elif o[:1] in ("l", "w") and o[1:].isdigit():
            kw["block_l" if o[0] == "l" else "num_warps"] = int(o[1:])
        else:
            raise SystemExit(f"--modules {spec!r}: unknown option {o!r} (lN, wN, biased, exact)")
    mod = importlib.import_module(f"mpinfer.model.kernels.{name}")
    return functools.partial(mod.decode_attention, **kw)


def case(attend, heads: int, batch: int, context, int8: bool, l2_bytes: int,
         n_splits: int | None = None) -> dict:  # fmt: skip
    """`context`: every row's history, or a list of each row's (a mixed batch)."""
    hd = 128
    lengths = [context] * batch if isinstance(context, int) else list(context)
    blocks_per_row = -(-(max(lengths) + 1) // BLOCK)
    n_blocks = batch * blocks_per_row
    per_token = 2 * heads * hd * (1 if int8 else 2) + (2 * heads * 4 if int8 else 0)
    read = sum(lengths) * per_token
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
    pos = torch.tensor(lengths, device="cuda")
    vf = torch.zeros(batch, dtype=torch.long, device="cuda")
    slopes = torch.rand(heads, device="cuda")
    out = torch.empty(batch, heads * hd, dtype=torch.float16, device="cuda")

    def call(i):
        k, v, s = caches[i]
        attend(qkv, k, v, slots, pos, vf, slopes, tables, out=out, scales=s, n_splits=n_splits)

    us = graph_time_us(call, copies, calls=max(copies, 12), reps=5)
    return {"heads": heads, "batch": batch, "context": sum(lengths) / batch,
            "kv": "int8" if int8 else "fp16", "splits": n_splits, "us": us, "bytes": read,
            "GBps": read / us / 1e3}  # fmt: skip


# A decode batch of the unique mix (loadgen's): prompts of 8 words x {1, 4, 16, 64} (about 20,
# 90, 350 and 1,400 tokens) with 0-255 tokens generated so far.
MIX_PROMPTS = (20, 90, 350, 1400)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def mixed(attend, l2: int) -> tuple[list[dict], list[list]]:
    """Mixed histories against the split count: the policy's (tuning.attention_splits) and
    every count in SPLITS, beside a batch of equal histories of the same mean at the policy's
    count. The SM that draws the long rows' programs finishes last; more, shorter programs even
    the SMs out."""
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    for shape, heads in CASES:
        for batch in (32, 64):
            pick = torch.randint(0, len(MIX_PROMPTS), (batch,), generator=gen).tolist()
            done = torch.randint(0, 256, (batch,), generator=gen).tolist()
            lengths = [MIX_PROMPTS[i] + d for i, d in zip(pick, done, strict=True)]
            policy = attention_splits(batch, heads, 2048, sm_count(0))
            for int8 in (False, True):
                even = case(attend, heads, batch, sum(lengths) // batch, int8, l2, policy)
                got = {n: case(attend, heads, batch, lengths, int8, l2, n)
                       for n in sorted({policy, *SPLITS})}  # fmt: skip
                best = min(got, key=lambda n: got[n]["us"])
                for r in (even, *got.values()):
                    r.update(shape=shape, mixed=r is not even)
                    rows.append(r)
                table.append([shape, batch, even["kv"], f"{even['context']:.0f}",
                              f"{even['us']:.1f}", policy, f"{got[policy]['us']:.1f}",
                              *(f"{got[n]['us']:.1f}" for n in SPLITS), best,
                              f"{got[policy]['us'] / got[best]['us']:.2f}"])  # fmt: skip
                torch.cuda.empty_cache()
    return rows, table


def equal(modules: list[str], l2: int) -> tuple[list[dict], list[list]]:
    """Every module's attention over equal histories, an fp16 and an int8 cache side by side."""
    rows, table = [], []
    for name in modules:
        attend = attention_fn(name)
        for shape, heads in CASES:
            for batch in (1, 32, 64):
                for context in (512, 2048):
                    pair = [case(attend, heads, batch, context, q, l2) for q in (False, True)]
                    for r in pair:
                        r.update(module=name, shape=shape)
                    rows += pair
                    f, q = pair
                    table.append([name, shape, batch, context, f"{f['us']:.1f}",
                                  f"{f['GBps']:.0f}", f"{q['us']:.1f}", f"{q['GBps']:.0f}",
                                  f"{q['us'] / f['us']:.2f}"])  # fmt: skip
                    torch.cuda.empty_cache()
    return rows, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", default="attention", help="kernel modules, comma-separated")
    ap.add_argument("--mixed", action="store_true",
                    help="mixed histories (the unique mix's) against the split count")  # fmt: skip
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gpu = torch.cuda.get_device_name()
    if a.mixed:
        rows, table = mixed(attention_fn(a.modules.split(",")[0]), l2)
        print(f"{gpu}: decode attention (both launches) over mixed histories by split count, us "
              "(equal: the same mean for every row)\n")  # fmt: skip
        print(md_table(["shape", "batch", "kv", "mean", "equal", "policy", "mixed at policy",
                        *(f"{n}" for n in SPLITS), "best", "policy / best"], table))  # fmt: skip
    else:
        rows, table = equal(a.modules.split(","), l2)
        print(f"{gpu}: decode attention (both launches), shuffled blocks of {BLOCK}, CUDA graph, "
              "cache from HBM\n")  # fmt: skip
        print(md_table(["kernels", "shape", "batch", "context", "fp16 us", "fp16 GB/s",
                        "int8 us", "int8 GB/s", "int8 / fp16"], table))  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": gpu, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
