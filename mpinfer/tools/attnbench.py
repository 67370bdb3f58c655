"""`mpinfer bench kernels --attention`: the decode attention kernel (kernels/attention.py, both
launches) alone, over a grid of tile lengths, warps, pipeline stages and splits per row and
head, for bloom-7b1 and one BLOOM-176B tp-8 rank, each case in a CUDA graph with the cache read
from HBM; the policy's own choice is marked. Its timer is the matmul benchmark's
(report.graph_time_us)."""

from __future__ import annotations

import itertools
import json

import torch

from ..model.kernels.tuning import attention_splits, sm_count
from .report import graph_time_us, l2_copies, md_table

# (name, batch, heads per rank): the decode attention of bloom-7b1 and of one BLOOM-176B tp-8 rank
ATTENTION_CASES = [("7b1", 1, 32), ("7b1", 8, 32), ("7b1", 32, 32), ("176b/8", 1, 14),
                   ("176b/8", 8, 14), ("176b/8", 32, 14)]  # fmt: skip


def attention_sweep(context: int, max_seqs: list[int], l2_bytes: int, dtype=torch.float16) -> dict:
    """Time the decode attention (kernels/attention.py, both launches) over a grid of tile
    lengths, warps, pipeline stages and splits per row and head, each case in a CUDA graph with
    the cache read from HBM (enough layers' caches to overflow L2); the policy's own choice is
    marked. Rows of the history are `context` long in a cache of each of `max_seqs` positions
    (the splits a captured graph can use depend on the cache length, not on the history's)."""
    rows = []
    for max_seq in max_seqs:
        for name, B, heads in ATTENTION_CASES:
            row = _attention_case(name, B, heads, context, max_seq, l2_bytes, dtype)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("all", "top")}),
                  flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "dtype": str(dtype), "rows": rows}


def _attention_case(name, B, heads, context, max_seq, l2_bytes, dtype) -> dict:
    from ..model.kernels import attention  # Triton: GPU only

    sms = sm_count(0)
    head_dim = 128
    read = 2 * B * heads * context * head_dim * 2
    copies = l2_copies(read, l2_bytes)
    caches = [(torch.randn(B, heads, max_seq, head_dim, device="cuda", dtype=dtype),
               torch.randn(B, heads, max_seq, head_dim, device="cuda", dtype=dtype))
              for _ in range(copies)]  # fmt: skip
    qkv = torch.randn(B, heads * 3 * head_dim, device="cuda", dtype=dtype)
    slots = torch.arange(B, device="cuda")
    pos = torch.full((B,), context, device="cuda")
    vf = torch.zeros(B, dtype=torch.long, device="cuda")
    slopes = torch.rand(heads, device="cuda")
    tables = slots.view(B, 1)  # one block of max_seq positions a row (the static layout)
    policy = attention_splits(B, heads, max_seq, sms)
    splits = sorted({policy, 1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 18, 24, 32}
                    | {max(1, -(-f * sms // (B * heads))) for f in (2, 4, 8, 16)})  # fmt: skip
    results = []
    grid = itertools.product((32, 64), (2, 4), (3,), splits)
    for block_l, warps, stages, n in grid:

        def call(i, block_l=block_l, warps=warps, stages=stages, n=n):
            k, v = caches[i]
            return attention.decode_attention(qkv, k, v, slots, pos, vf, slopes, tables,
                                              n_splits=n, block_l=block_l, num_warps=warps,
                                              num_stages=stages)  # fmt: skip

        try:
            us = graph_time_us(call, copies, calls=max(copies, 12), reps=3)
        except Exception as e:  # e.g. out of shared memory
            us = None
            print(f"attention {name} b={B} l{block_l} w{warps} s{stages} n{n}: {e}"[:300])
        results.append({"block_l": block_l, "warps": warps, "stages": stages, "splits": n,
                        "us": us})  # fmt: skip
    ok = sorted((r for r in results if r["us"]), key=lambda r: r["us"])
    default = (attention.TILE_KEYS, attention.WARPS, attention.STAGES, policy)
    current = next(r for r in results
                   if (r["block_l"], r["warps"], r["stages"], r["splits"]) == default)  # fmt: skip
    return {"case": name, "batch": B, "heads": heads, "context": context, "max_seq": max_seq,
            "bytes": read, "policy_splits": policy, "default_us": current["us"],
            "best": ok[0], "top": ok[:8], "all": results}  # fmt: skip


def attention_markdown(result: dict, bandwidth: float) -> str:
    header = ["case", "batch", "cache", "MB read", "default us", "% of copy", "best us",
              "% of copy", "best: tile, warps, stages, splits"]  # fmt: skip
    rows = []
    for r in result["rows"]:
        b = r["best"]
        rows.append([r["case"], r["batch"], r["max_seq"], f"{r['bytes'] / 1e6:.0f}",
                     f"{r['default_us']:.1f}",
                     f"{100 * r['bytes'] / r['default_us'] / 1e3 / bandwidth:.0f}",
                     f"{b['us']:.1f}", f"{100 * r['bytes'] / b['us'] / 1e3 / bandwidth:.0f}",
                     f"{b['block_l']}, {b['warps']}, {b['stages']}, {b['splits']}"])  # fmt: skip
    first = result["rows"][0]
    return (f"{result['gpu']}: decode attention (both launches), context {first['context']}, "
            "in a CUDA graph\n\n" + md_table(header, rows))  # fmt: skip
