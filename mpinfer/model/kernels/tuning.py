"""The W8A16 kernel's configurations, by name, and the per-GPU tables of measured best ones.
Free of Triton, so that CPU CI (which has none) checks every shipped table.

A config's name is its loop and its Triton meta-parameters, e.g. "dot n64 k128 split4 pf0 magic2
w4 s3": loop (dot: tensor cores; swap: tensor cores with the weight tile as the left operand;
fma: the one-row elementwise loop), BLOCK_N, BLOCK_K, split-K, PREFETCH, MAGIC (how int8 becomes
float: 0 the conversion unit via fp32, 1 the fp16 bit trick in Triton ops, fp16 only, 2 the bit
trick in packed PTX, four weights at a time), num_warps, num_stages.

Why tables: the autotuner times each candidate once per process with Triton's timer (one launch
between L2 flushes), whose run-to-run spread (several microseconds on a 10-40 us kernel) is larger
than the gap between the best few candidates, so every start-up picked differently, up to 30 %
apart on a shape. `mpinfer bench kernels --tune` instead times every candidate as the model runs
it, in a CUDA graph with the weight read from HBM, re-times the leaders, and writes the winners
to `tuned/<gpu>.json`; a launch whose (dtype, row bucket, N, K) is in the table of the GPU it runs
on uses that config, and any other launch is autotuned as before.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).parent / "tuned"
# The W8A16 kernel's tuning buckets: one row, then row tiles of up to 16, 32 and 64 rows. Each
# bucket is tuned on its own; the engine warms each one up at start-up.
ROW_BUCKETS = (1, 16, 32, 64)
# Query tokens per tile of the prompt-chunk attention kernel (kernels/attention.py); the runner
# cuts chunks into tiles of this many.
CHUNK_TILE = 64
WORKSPACE_BYTES = 16 << 20  # per device: the largest split-K partials a launch may write
COUNTERS = 1 << 15  # per device: one int32 per output tile

# (loop, BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH). The autotuner's families won a shape
# in a sweep over 10 on the H200; SWAP is for several rows only, the fma loop for one row only.
AUTOTUNE_FAMILIES = [
    ("dot", 32, 256, 4, 3, 0), ("dot", 64, 256, 4, 3, 0), ("dot", 64, 128, 4, 3, 0),
    ("swap", 64, 128, 4, 4, 0), ("fma", 16, 256, 4, 3, 0), ("fma", 8, 512, 4, 1, 1),
]  # fmt: skip
AUTOTUNE_SPLITS = (1, 2, 4, 8)
# The int8 conversions the autotuner tries, per activation dtype: those that won a launch in the
# sweep on the H200 (its table in docs/performance.md). fp16: packed PTX 36 of 40, by up to
# 1.20x over the best of the other two, the Triton-op trick the other 4 (by up to 1.12x);
# bf16: Triton's own conversion 36 of 40 (the tensor-core loops, by up to 1.07x), packed PTX the
# one-row loop. Two per dtype: as many candidates as before packed PTX came.
AUTOTUNE_MAGIC = {"float16": (1, 2), "bfloat16": (0, 2)}
# The sweep behind a table also tries wider, deeper and smaller tiles, and splits that are not
# powers of two (programs = tiles x splits decides how evenly the last wave fills the GPU).
SWEEP_FAMILIES = AUTOTUNE_FAMILIES + [
    ("dot", 32, 128, 4, 4, 0), ("dot", 64, 128, 4, 5, 0), ("dot", 64, 256, 8, 3, 0),
    ("dot", 128, 128, 8, 3, 0), ("swap", 64, 256, 4, 3, 0), ("fma", 16, 512, 4, 1, 1),
]  # fmt: skip
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)

_NAME = re.compile(r"(dot|swap|fma) n(\d+) k(\d+) split(\d+) pf([01]) magic([012]) w(\d+) s(\d+)")


@functools.cache
def parse(name: str) -> tuple[dict, int, int]:
    """(Triton meta-parameters, num_warps, num_stages) of a config name."""
    m = _NAME.fullmatch(name)
    if not m:
        raise ValueError(f"not a W8A16 config name: {name!r} (e.g. 'dot n64 k128 split4 pf0 "
                         "magic0 w4 s3')")  # fmt: skip
    loop, bn, bk, split, pf, magic, w, s = m.groups()
    kw = dict(USE_DOT=int(loop != "fma"), SWAP=int(loop == "swap"), BLOCK_N=int(bn),
              BLOCK_K=int(bk), split_k=int(split), PREFETCH=int(pf), MAGIC=int(magic))  # fmt: skip
    return kw, int(w), int(s)


def name(kw: dict, num_warps: int, num_stages: int) -> str:
    loop = ("swap" if kw.get("SWAP") else "dot") if kw["USE_DOT"] else "fma"
    return (f"{loop} n{kw['BLOCK_N']} k{kw['BLOCK_K']} split{kw['split_k']} pf{kw['PREFETCH']} "
            f"magic{kw.get('MAGIC', 0)} w{num_warps} s{num_stages}")  # fmt: skip


def dtype_name(dtype) -> str:
    """The name a table key gives a torch dtype: torch.float16 -> 'float16'."""
    return str(dtype).removeprefix("torch.")


def magics(dtype: str) -> tuple[int, ...]:
    """The int8 conversions a launch of this activation dtype may use (1 makes fp16 only)."""
    return (0, 1, 2) if dtype == "float16" else (0, 2)


def names(families, splits, dtype: str, magic=None) -> list[str]:
    """Every config of these families and splits, with every conversion `dtype` allows (or
    those of `magic` only)."""
    return [
        f"{loop} n{bn} k{bk} split{split} pf{pf} magic{m} w{w} s{s}"
        for loop, bn, bk, w, s, pf in families
        for split in splits
        for m in magics(dtype)
        if magic is None or m in magic
    ]


def row_bucket(rows: int) -> int:
    """The tuning bucket of a launch with this many rows: 1, then the row tile (16, 32, 64)."""
    assert rows <= ROW_BUCKETS[-1], f"{rows} rows: more than a decode launch has"
    return next(b for b in ROW_BUCKETS if b >= rows)


def key(dtype: str, rows: int, N: int, K: int) -> str:
    """A table key: 'float16 m16 12288x4096' (dtype, row bucket, out x in features)."""
    return f"{dtype} m{row_bucket(rows)} {N}x{K}"


def illegal(name_: str, rows: int, N: int, K: int, dtype: str) -> str | None:
    """Why this config cannot run a launch of rows x K by N (None if it can)."""
    kw, _, _ = parse(name_)
    split, bn, bk = kw["split_k"], kw["BLOCK_N"], kw["BLOCK_K"]
    if not kw["USE_DOT"] and rows != 1:
        return "the fma loop computes one row"
    if kw["SWAP"] and rows == 1:
        return "swap is for several rows"
    if kw["MAGIC"] not in magics(dtype):
        return "the Triton-op bit trick (magic1) makes fp16 only"
    # The autotuner keeps one config per row bucket, so the partials must fit at the bucket's
    # most rows (a config picked at 2 rows runs 16).
    if split > 1 and split * row_bucket(rows) * N * 4 > WORKSPACE_BYTES:
        return f"split-K partials over the {WORKSPACE_BYTES >> 20} MiB workspace"
    if bk * split > max(K, bk):
        return "a split shorter than one K tile"
    if -(-N // bn) > COUNTERS:
        return "more output tiles than split-K counters"
    return None


def slug(gpu_name: str) -> str:
    """The table file's name for a GPU: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


_KEY = re.compile(r"(float16|bfloat16) m(\d+) (\d+)x(\d+)")


@functools.cache
def table(gpu_name: str) -> dict[str, str]:
    """The shipped table of this GPU (key -> config name), {} when there is none or when
    MPINFER_TUNED=0 (a diagnostic switch: everything autotuned). A table that does not parse is
    an error naming the file and the entry, not a silent fall-back to autotuning."""
    path = TABLE_DIR / f"{slug(gpu_name)}.json"
    if os.environ.get("MPINFER_TUNED", "1") == "0" or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        configs = dict(data["configs"])
        for k, config in configs.items():
            m = _KEY.fullmatch(k)
            if not m or int(m[2]) not in ROW_BUCKETS:
                raise ValueError(f"bad key {k!r} (e.g. 'float16 m16 12288x4096')")
            parse(config)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a W8A16 config table: {e}") from None
    if data.get("gpu") != gpu_name:
        return {}
    return configs


def lookup(gpu_name: str, dtype: str, rows: int, N: int, K: int) -> str | None:
    """The table's config for this launch, if it has one that can run it."""
    found = table(gpu_name).get(key(dtype, rows, N, K))
    if found is None or illegal(found, rows, N, K, dtype):
        return None
    return found


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def attention_splits(batch: int, heads: int, max_seq: int, sms: int) -> int:
    """Programs per row and head of the decode attention (attention.py), which cuts each row's
    history into this many equal runs of 32-key tiles at run time: enough that batch x heads x
    splits gives every SM about 8 programs (batch 1 with 14 or 32 heads still fills the GPU),
    but no more than the cache has tiles, nor than 32, past which a short history leaves most
    programs empty and the merge grows (the attention sweep, docs/performance.md). It depends
    only on
    the batch and the cache length, so a captured graph stays valid."""
    return max(1, min(-(-8 * sms // (batch * heads)), -(-max_seq // 32), 32))
