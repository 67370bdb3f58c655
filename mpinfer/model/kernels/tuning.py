"""The weight-only matmul kernels' configurations, by name, the deterministic default for a
launch, and the per-GPU tables of measured best ones. Free of Triton, so that CPU CI (which has
none) checks every shipped table.

A config's name is its loop and its Triton meta-parameters, e.g. "dot n64 k128 split4 pf0 magic2
w4 s3" or, for launches of more than 64 rows, "swap n128 k64 split1 pf0 magic2 w8 s3 m128":
loop (dot: tensor cores; swap: tensor cores with the weight tile as the left operand; fma: the
one-row elementwise loop), BLOCK_N, BLOCK_K, split-K, PREFETCH, MAGIC (how a quantized weight
becomes float: 0 the conversion unit via fp32, 1 the fp16 bit trick in Triton ops, fp16 only, 2
the bit trick in packed PTX, int8 only; 3-5 int4's one-row tricks, 6 int8's pairs in PTX for
the swap loop, 7 int4's pairs of exact q for the swap loop, scale and offset per group, 8
int4's one-row loop in packed fp16, four bytes a word, 9 the same with each group's sum of x
from the launcher),
num_warps, num_stages, BLOCK_M (the rows a program owns; without it, the row bucket's size: 16,
32 or 64), and optionally "r80", the registers a thread may use (Triton's maxnreg: fewer, for
more programs an SM).

Both kernels (w8a16.py, w4a16.py) cover every row count a step can have with one family of
loops: one row, tiles of up to 64 rows, and tiles of BLOCK_M rows repeated over the rows for
more (a mixed step, a prefill). The int4 kernel's BLOCK_K is the quantization group (one scale
and offset per tile row).

Which config a launch runs is a function of the GPU and the launch's shape only: the GPU's table
(`tuned/<gpu>.json`, measured by `mpinfer bench kernels --tune`, which times every candidate as
the model runs it, in a CUDA graph with the weight read from HBM, and re-times the leaders), else
`default_config`. No timing race at start-up picks a kernel (Triton's autotuner did, once: its
timer's spread is larger than the gap between the leaders, so two starts of the same server
could pick differently and round differently), so two machines of one kind give the same
greedy text.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).parent / "tuned"
# Tuning buckets of a launch's rows: one row, row tiles of up to 16, 32 and 64 rows (one tile),
# then 128 ... 1024 rows (tiles of the config's BLOCK_M; more rows use the largest bucket's
# config). The engine's step graphs run every bucket at start-up.
ROW_BUCKETS = (1, 16, 32, 64, 128, 256, 512, 1024)
SINGLE_TILE = 64  # buckets up to this many rows are one tile of rows
# Query tokens a tile of the prompt-chunk attention kernel (kernels/attention.py; runner's chunks)
CHUNK_TILE = 64
WORKSPACE_BYTES = 32 << 20  # per device: the largest split-K partials a launch may write
COUNTERS = 1 << 15  # per device: one int32 per output tile
INT4_GROUPS = (64, 128, 256)  # quant.group_size values the int4 kernel runs (BLOCK_K = group)

# The sweep behind a table: (loop, BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH, BLOCK_M)
# (BLOCK_M 0: the bucket's rows). The few-row families won a shape in a sweep over 10 on the
# H200; the tiled ones are the shapes Triton's Hopper matmuls favour for 128-1024 rows.
SWEEP_FAMILIES = [
    ("dot", 32, 256, 4, 3, 0, 0), ("dot", 64, 256, 4, 3, 0, 0), ("dot", 64, 128, 4, 3, 0, 0),
    ("swap", 64, 128, 4, 4, 0, 0), ("fma", 16, 256, 4, 3, 0, 0), ("fma", 8, 512, 4, 1, 1, 0),
    ("dot", 32, 128, 4, 4, 0, 0), ("dot", 64, 128, 4, 5, 0, 0), ("dot", 64, 256, 8, 3, 0, 0),
    ("dot", 128, 128, 8, 3, 0, 0), ("swap", 64, 256, 4, 3, 0, 0), ("fma", 16, 512, 4, 1, 1, 0),
]  # fmt: skip
TILED_FAMILIES = [
    ("dot", 128, 64, 8, 3, 0, 128), ("dot", 256, 64, 8, 3, 0, 128), ("dot", 128, 128, 8, 3, 0, 64),
    ("dot", 128, 64, 4, 4, 0, 64), ("swap", 128, 64, 8, 3, 0, 128), ("swap", 128, 128, 8, 3, 0, 64),
    ("swap", 256, 64, 8, 3, 0, 128), ("swap", 64, 128, 4, 4, 0, 128),
    # Round 5: 256 rows a program (the tensor cores' widest tile: each converted weight feeds
    # twice the products, and in the swap loop the conversion is what competes with them) and
    # K tiles of 128 (half the barriers a product); Triton 3.6 keeps none of the dot loop's
    # products in flight across its converted tile (it waits for each), the swap loop up to 3.
    ("swap", 128, 64, 8, 3, 0, 256), ("swap", 128, 64, 8, 4, 0, 256),
    ("swap", 64, 64, 4, 4, 0, 256), ("dot", 128, 128, 8, 3, 0, 128),
    # Round 13: the warp-specialized swap loop (w8a16_tma.py: a producer warp group's copies
    # feeding two consumers; 4 warps a partition), no split
    ("tma", 128, 64, 4, 3, 0, 128), ("tma", 128, 64, 4, 4, 0, 128), ("tma", 128, 64, 4, 3, 0, 256),
    ("tma", 256, 64, 4, 3, 0, 128), ("tma", 128, 128, 4, 3, 0, 128), ("tma", 128, 64, 4, 4, 0, 64),
]  # fmt: skip
# Round 15: the warp-specialized loop over one tile of the 32- and 64-row buckets' rows (the
# tensor cores' narrow operand), swept with the tiled splits and conversions
FEW_ROW_TMA, TMA_MIN_BUCKET = [("tma", 128, 128, 4, 3, 0, 0), ("tma", 128, 64, 4, 4, 0, 0),
                               ("tma", 256, 64, 4, 3, 0, 0)], 32  # fmt: skip
# int4: BLOCK_K is the group size, set per launch; these are the families at 128.
INT4_FAMILIES = [
    ("fma", 16, 128, 4, 3, 0, 0), ("fma", 32, 128, 4, 3, 0, 0), ("fma", 64, 128, 4, 3, 0, 0),
    ("fma", 16, 128, 4, 3, 1, 0), ("fma", 32, 128, 4, 3, 1, 0), ("fma", 128, 128, 4, 3, 0, 0),
    ("fma", 64, 128, 8, 3, 0, 0), ("fma", 128, 128, 8, 3, 0, 0), ("fma", 64, 128, 4, 3, 1, 0),
    # Round 11: the one-row loop of two groups an iteration capped at 80 registers a thread (an
    # eighth field: Triton's maxnreg; 96 uncapped), six programs an SM instead of five: Nsight
    # Compute found it waiting on its loads with the warps its registers allow (Triton 3.6
    # compiles it for sm_90a with no spills at 80; at 72 it spills)
    ("fma", 64, 128, 4, 3, 1, 0, 80),
    # Round 12: magic8 (the one-row loop's families above run it too) with two rows a thread
    # over 8 warps, and four over 2 warps (its x work, once a thread, shared by more rows; no
    # layout conversion through shared memory, which four rows a thread over 4 warps has)
    ("fma", 128, 128, 8, 3, 1, 0), ("fma", 64, 128, 2, 3, 1, 0), ("fma", 64, 128, 2, 3, 0, 0),
    # Round 13: in the packed loop (magic8, magic9) num_stages 2 or more carries the next tile's
    # weights across iterations (a register pipeline), 1 does not: the families above carry,
    # these two do not (and run the packed loop alone: the other loops ignore num_stages)
    ("fma", 64, 128, 4, 1, 1, 0), ("fma", 64, 128, 2, 1, 1, 0),
    ("dot", 64, 128, 4, 4, 0, 0),
    ("dot", 32, 128, 4, 3, 0, 0), ("dot", 64, 128, 4, 3, 0, 0), ("swap", 64, 128, 4, 4, 0, 0),
    ("swap", 128, 128, 4, 3, 0, 0),
    # Round 11: magic7's swap loop from one row: two warpgroups, 64 or 128 weight rows each (a
    # group's fixed instructions shared by more weights), and a deeper pipeline
    ("swap", 128, 128, 8, 3, 0, 0), ("swap", 256, 128, 8, 3, 0, 0), ("swap", 256, 128, 8, 4, 0, 0),
    ("swap", 64, 128, 4, 6, 0, 0),
    ("dot", 128, 128, 8, 3, 0, 128), ("dot", 128, 128, 8, 3, 0, 64),
    ("swap", 128, 128, 8, 3, 0, 128), ("swap", 128, 128, 8, 3, 0, 64),
    ("swap", 256, 128, 8, 3, 0, 128),
]  # fmt: skip
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
INT4_SPLITS = (1, 2, 3, 4, 6, 8)
TILED_SPLITS = (1, 2, 3, 4)
# Conversions the tiled sweep tries (the few-row sweep tries all): per dtype, those that won
# the tensor-core loops of the few-row sweep, and for fp16 magic6 (the swap loop's pairs).
TILED_MAGIC = {"float16": (1, 2, 6), "bfloat16": (0, 2)}

_NAME = re.compile(
    r"(dot|swap|fma|tma) n(\d+) k(\d+) split(\d+) pf([01]) magic([0-9]) w(\d+) s(\d+)(?: m(\d+))?"
    r"(?: r(\d+))?"
)


@functools.cache
def parse(name: str) -> tuple[dict, int, int]:
    """(Triton meta-parameters, num_warps, num_stages) of a config name; BLOCK_M 0: the row
    bucket's."""
    m = _NAME.fullmatch(name)
    if not m:
        raise ValueError(f"not a kernel config name: {name!r} (e.g. 'dot n64 k128 split4 pf0 "
                         "magic0 w4 s3')")  # fmt: skip
    loop, bn, bk, split, pf, magic, w, s, bm, regs = m.groups()
    kw = dict(USE_DOT=int(loop != "fma"), SWAP=int(loop in ("swap", "tma")),
              TMA=int(loop == "tma"), BLOCK_N=int(bn), BLOCK_K=int(bk), split_k=int(split),
              PREFETCH=int(pf), MAGIC=int(magic), BLOCK_M=int(bm or 0),
              MAXNREG=int(regs or 0))  # fmt: skip
    return kw, int(w), int(s)


def name(kw: dict, num_warps: int, num_stages: int) -> str:
    loop = ("tma" if kw.get("TMA") else "swap" if kw.get("SWAP") else "dot") if kw["USE_DOT"] \
        else "fma"  # fmt: skip
    tail = f" m{kw['BLOCK_M']}" if kw.get("BLOCK_M") else ""
    tail += f" r{kw['MAXNREG']}" if kw.get("MAXNREG") else ""
    return (f"{loop} n{kw['BLOCK_N']} k{kw['BLOCK_K']} split{kw['split_k']} pf{kw['PREFETCH']} "
            f"magic{kw.get('MAGIC', 0)} w{num_warps} s{num_stages}{tail}")  # fmt: skip


def dtype_name(dtype) -> str:
    """The name a table key gives a torch dtype: torch.float16 -> 'float16'."""
    return str(dtype).removeprefix("torch.")


def magics(dtype: str, bits: int = 8) -> tuple[int, ...]:
    """The weight conversions a launch of this activation dtype may use (1 makes fp16 only; 2,
    packed PTX, makes any dtype for int8, and for int4 fp16 weights: any dtype in the one-row
    loop, fp16 only in the tensor-core loops, which `illegal` says; 3 and 4, int4's fp32
    mantissa trick in Triton ops and in PTX, and 5, the PTX one with the scale and offset applied
    once per run of eight weights: the one-row loop only; 6, int8's packed PTX two weights a
    call, fp16 in the swap loop only; 7, int4's pairs of exact q, fp16 in the swap loop only; 8,
    int4's products in packed fp16, fp16 in the one-row loop only, and 9, the same with the
    launcher's sums of x)."""
    base = (0, 1, 2) if dtype == "float16" else (0, 2)
    if bits == 4:
        return base + (3, 4, 5) + ((7, 8, 9) if dtype == "float16" else ())
    return base + (6,) if dtype == "float16" else base


def names(families, splits, dtype: str, magic=None, *, bits: int = 8, group: int = 128
          ) -> list[str]:  # fmt: skip
    """Every config of these families and splits, with every conversion `dtype` allows (or
    those of `magic` only); int4 configs take BLOCK_K from the group size."""
    out = []
    for loop, bn, bk, w, s, pf, bm, *regs in families:
        bk = group if bits == 4 else bk
        for split in splits:
            for m in magics(dtype, bits):
                if loop == "fma" and bits == 4 and m == 1:
                    continue  # the one-row int4 loop runs magic1 as magic0
                if m in (3, 4, 5, 8, 9) and not (loop == "fma" and bits == 4):
                    continue  # the mantissa trick and packed fp16 are the one-row int4 loop's
                if m in (6, 7) and loop not in ("swap", "tma"):
                    continue  # int8's and int4's pairs are the swap loop's fragment
                if loop == "fma" and bits == 4 and s < 2 and m < 8:
                    continue  # num_stages 1 is the packed loop's; the others compile the same
                if magic is None or m in magic:
                    out.append(name(dict(USE_DOT=int(loop != "fma"), TMA=int(loop == "tma"),
                                         SWAP=int(loop in ("swap", "tma")),
                                         BLOCK_N=bn, BLOCK_K=bk, split_k=split, PREFETCH=pf,
                                         MAGIC=m, BLOCK_M=bm, MAXNREG=sum(regs)), w,
                                    s))  # fmt: skip
    return out


# What the int4 one-row loop's sweep leaves out: magic0 lost every one-row launch to magic2 on
# the H200 (round 4), and magic3 is magic4 in Triton ops (what the CPU's interpreter runs).
INT4_FMA_UNSWEPT = (0, 3)


def candidates(bucket: int, dtype: str, *, bits: int = 8, group: int = 128) -> list[str]:
    """What `--tune` sweeps for a row bucket (illegal ones are dropped per launch)."""
    if bits == 4:
        fams = [f for f in INT4_FAMILIES if (f[6] > 0) == (bucket > SINGLE_TILE)]
        out = names(fams, INT4_SPLITS if bucket <= SINGLE_TILE else TILED_SPLITS, dtype, bits=4,
                    group=group)  # fmt: skip
        return [n for n in out if not (n.startswith("fma") and parse(n)[0]["MAGIC"]
                                       in INT4_FMA_UNSWEPT)]  # fmt: skip
    if bucket > SINGLE_TILE:
        return names(TILED_FAMILIES, TILED_SPLITS, dtype, TILED_MAGIC[dtype])
    tma = names(FEW_ROW_TMA, TILED_SPLITS, dtype, TILED_MAGIC[dtype]) * (bucket >= TMA_MIN_BUCKET)
    return names(SWEEP_FAMILIES, SWEEP_SPLITS, dtype) + tma


def row_bucket(rows: int) -> int:
    """The tuning bucket of a launch with this many rows: 1, the row tile (16, 32, 64), then
    128 ... 1024 (and 1024 for more)."""
    return next((b for b in ROW_BUCKETS if b >= rows), ROW_BUCKETS[-1])


def block_m(kw: dict, rows: int) -> int:
    """The rows one program owns: the config's BLOCK_M, else the bucket's (at least 16, the
    tensor cores' smallest tile)."""
    return kw.get("BLOCK_M") or max(16, min(row_bucket(rows), SINGLE_TILE))


def key(dtype: str, rows: int, N: int, K: int, *, bits: int = 8, group: int = 0) -> str:
    """A table key: 'float16 m16 12288x4096' (int8: dtype, row bucket, out x in features);
    'int4g128 float16 m16 12288x4096' (int4 with groups of 128)."""
    head = f"int4g{group} " if bits == 4 else ""
    return f"{head}{dtype} m{row_bucket(rows)} {N}x{K}"


def illegal(name_: str, rows: int, N: int, K: int, dtype: str, *, bits: int = 8,
            group: int = 0) -> str | None:  # fmt: skip
    """Why this config cannot run a launch of rows x K by N (None if it can)."""
    kw, w, _ = parse(name_)
    split, bn, bk, bm = kw["split_k"], kw["BLOCK_N"], kw["BLOCK_K"], kw["BLOCK_M"]
    bucket = row_bucket(rows)
    if not kw["USE_DOT"] and rows != 1:
        return "the fma loop computes one row"
    if kw["SWAP"] and rows == 1 and kw["MAGIC"] != 7:
        return "swap is for several rows (int4's magic7 aside)"
    if kw["TMA"]:
        if bits != 8:
            return "the tma loop is int8's (int4's lost every launch to the swap loop, round 15)"
        if (bm > 0) != (bucket > SINGLE_TILE):
            return f"a tma config names a BLOCK_M over {SINGLE_TILE} rows, none for fewer rows"
        if bucket < TMA_MIN_BUCKET:
            return f"the tma loop is for more than {TMA_MIN_BUCKET // 2} rows"
        if w != 4:
            return "the tma loop runs 4 warps a partition (Triton warp-specializes no other)"
        if K % 16:
            return "the tma loop's copies need rows of a multiple of 16 bytes"
    if kw["MAGIC"] not in magics(dtype, bits):
        if kw["MAGIC"] == 6:
            return "magic6 (int8 pairs in PTX) makes fp16 from int8 only"
        if kw["MAGIC"] == 7:
            return "magic7 (int4 pairs of q) makes fp16 weights, from int4 only"
        if kw["MAGIC"] >= 8:
            return "magic8-9 (int4 products in packed fp16) take fp16 activations and int4 only"
        if kw["MAGIC"] >= 3:
            return "magic3-5 (the fp32 mantissa trick) are int4's"
        return "magic1 (the Triton-op bit trick) makes fp16 only"
    if kw["MAGIC"] == 6 and not kw["SWAP"]:
        return "magic6 (int8 pairs in PTX) is for the swap loop"
    if kw["MAGIC"] == 7 and not kw["SWAP"]:
        return "magic7 (int4 pairs of q) is for the swap loop"
    if 3 <= kw["MAGIC"] <= 5 and kw["USE_DOT"]:
        return "magic3-5 (fp32 weights) are for the one-row loop"
    if kw["MAGIC"] >= 8 and kw["USE_DOT"]:
        return "magic8-9 (packed fp16 products) are for the one-row loop"
    if bits == 4 and kw["MAGIC"] == 2 and kw["USE_DOT"] and dtype != "float16":
        return "int4's magic2 makes fp16 weights: the tensor-core loops need the activations' dtype"
    if bits == 4 and kw["MAGIC"] == 2 and kw["SWAP"]:
        # Measured on the H200 (Triton 3.6): swap n128 k128 split3 magic2 w8 s3 m64 gave
        # different sums from one call to the next on 5376 x 14336 at 128 and 150 rows (errors
        # to 1.5e-2 of the largest output); magic1 and the dot loop never did. The cause was
        # not found, so the packed conversion stays out of the loop that feeds the converted
        # tile to the tensor cores from registers.
        return "int4's magic2 is not used in the swap loop (it was not repeatable there)"
    if bm and bucket <= SINGLE_TILE:
        return f"a BLOCK_M is for more than {SINGLE_TILE} rows"
    if not bm and bucket > SINGLE_TILE:
        return f"more than {SINGLE_TILE} rows need a BLOCK_M (m64, m128, ...)"
    if bits == 4 and bk != group:
        return f"an int4 config's BLOCK_K is its group size ({group})"
    # A config serves its whole bucket, so the partials must fit at the bucket's most rows (a
    # config picked at 2 rows runs 16); past the largest bucket, at the launch's own.
    if split > 1 and split * max(rows, bucket) * N * 4 > WORKSPACE_BYTES:
        return f"split-K partials over the {WORKSPACE_BYTES >> 20} MiB workspace"
    if bk * split > max(K, bk):
        return "a split shorter than one K tile"
    if -(-N // bn) * -(-max(rows, bucket) // block_m(kw, rows)) > COUNTERS and split > 1:
        return "more output tiles than split-K counters"
    return None


def default_config(rows: int, N: int, K: int, dtype: str, sms: int, *, bits: int = 8,
                   group: int = 0) -> str:  # fmt: skip
    """The config of a launch no table has: a fixed rule of the shape and the GPU's size (the
    families that won most launches of the H200's sweep), the split the smallest that gives
    every SM a program."""
    bucket = row_bucket(rows)
    fp16 = dtype == "float16"
    if bits == 4:  # the packed conversion where it won the H200's sweep (never in swap)
        magic, bk = 2 if rows == 1 or (fp16 and bucket <= SINGLE_TILE) else int(fp16), group
    else:
        magic, bk = 2 if fp16 or rows == 1 else 0, 128
    if rows == 1 and bits == 4:
        # magic5's one-row loop won every one-row int4 launch of the H100's sweeps (rounds 5-6),
        # 64 rows a program, the K groups cut into splits of at least three (more programs in
        # flight), and for a weight of 64 MiB or more two groups an iteration (BLOOM-176B at tp
        # 1: 1.16-1.31x over one group and the fewest splits that fill the GPU)
        pf = int(N * K // 2 >= 64 << 20)
        base = f"fma n64 k{bk} split{{}} pf{pf} magic5 w4 s3"
        tiles = -(-N // 64) / 4
    elif rows == 1:
        base = f"fma n16 k256 split{{}} pf0 magic{magic} w4 s3"
        tiles = -(-N // 16)
    elif bucket <= SINGLE_TILE:
        base = f"dot n64 k{bk} split{{}} pf0 magic{magic} w4 s3"
        tiles = -(-N // 64)
    else:
        bn, bm = (128, 128) if bits == 8 else (128, 64)
        base = f"swap n{bn} k{64 if bits == 8 else bk} split{{}} pf0 magic{magic} w8 s3 m{bm}"
        tiles = -(-N // bn) * -(-rows // bm)
    legal = [
        s
        for s in (1, 2, 3, 4, 6, 8)
        if not illegal(base.format(s), rows, N, K, dtype, bits=bits, group=group)
    ]
    split = next((s for s in legal if tiles * s >= sms), legal[-1] if legal else 1)
    if rows == 1 and bits == 4:  # and at least three groups a split, as many splits as that allows
        split = max(split, next((s for s in reversed(legal) if K // group >= 3 * s), 1))
    return base.format(split)


def slug(gpu_name: str) -> str:
    """The table file's name for a GPU: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


_KEY = re.compile(r"(?:int4g(\d+) )?(float16|bfloat16) m(\d+) (\d+)x(\d+)")


@functools.cache
def _shipped(gpu_name: str) -> dict:
    """The shipped table file of this GPU, checked ({} when there is none, when it is another
    GPU's, or when MPINFER_TUNED=0: a diagnostic switch, every launch gets `default_config`). A
    table that does not parse is an error naming the file and the entry, not a silent
    fall-back."""
    path = TABLE_DIR / f"{slug(gpu_name)}.json"
    if os.environ.get("MPINFER_TUNED", "1") == "0" or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        configs = dict(data["configs"])
        for k, config in configs.items():
            m = _KEY.fullmatch(k)
            if not m or int(m[3]) not in ROW_BUCKETS:
                raise ValueError(f"bad key {k!r} (e.g. 'float16 m16 12288x4096')")
            parse(config)
        for field in CROSSOVERS.values():
            rows = data.get(field)
            if rows is not None and not (isinstance(rows, int) and rows >= SINGLE_TILE):
                raise ValueError(f"{field}={rows!r} must be an integer >= {SINGLE_TILE}")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a kernel config table: {e}") from None
    return data if data.get("gpu") == gpu_name else {}


def table(gpu_name: str) -> dict[str, str]:
    """The shipped table of this GPU (key -> config name); {} where `_shipped` has none."""
    return dict(_shipped(gpu_name).get("configs", {}))


# A table's crossovers, per weight width: past how many rows a launch dequantizes its weight
# (each measured by a served mix of that width, not by the kernel sweep)
CROSSOVERS = {8: "dequant_rows", 4: "int4_dequant_rows"}


def dequant_rows(gpu_name: str, bits: int = 8) -> int | None:
    """Past how many rows this GPU's table has a launch of `bits`-wide weights dequantize them
    for cuBLAS (kernels/__init__.py), where the table says (measured on that GPU); else None."""
    return _shipped(gpu_name).get(CROSSOVERS[bits])


def lookup(gpu_name: str, dtype: str, rows: int, N: int, K: int, *, bits: int = 8,
           group: int = 0) -> str | None:  # fmt: skip
    """The table's config for this launch, if it has one that can run it."""
    found = table(gpu_name).get(key(dtype, rows, N, K, bits=bits, group=group))
    if found is None or illegal(found, rows, N, K, dtype, bits=bits, group=group):
        return None
    return found


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The decode attention's fewest splits a row (MPINFER_ATTN_MIN_SPLITS, a diagnostic switch:
# 1 is the policy before round 16).
ATTN_MIN_SPLITS = int(os.environ.get("MPINFER_ATTN_MIN_SPLITS", "8"))


def attention_splits(batch: int, heads: int, max_seq: int, sms: int) -> int:
    """Programs per row and head of the decode attention (attention.py), which cuts each row's
    history into this many equal runs of 32-key tiles at run time: enough that batch x heads x
    splits gives every SM about 8 programs (batch 1 with 14 or 32 heads still fills the GPU),
    and at least ATTN_MIN_SPLITS: a step's rows have histories of every length, and the SM
    that drew long rows' programs finishes last (on an H100 the unique mix's histories at batch
    32 and 64 took 1.10-1.31 x longer at the old 1-3 splits than at 8: `kv_attention --mixed`).
    No more than the cache has tiles, nor than 32, past which a short history leaves most
    programs empty and the merge grows. It depends only on the batch and the cache length, so
    a captured graph stays valid."""
    fill = max(-(-8 * sms // (batch * heads)), ATTN_MIN_SPLITS)
    return max(1, min(fill, -(-max_seq // 32), 32))
