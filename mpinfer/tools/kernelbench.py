"""`mpinfer bench kernels`: the decode matmul alone, per weight shape of bloom-7b1 and of one
BLOOM-176B tp-8 rank, at 1, 8 and 32 rows: mpinfer's W8A16 kernel against cuBLAS fp16 on the
same shape, and both against the device-to-device copy bandwidth measured in the same run.

Each kernel is timed inside a CUDA graph (launch overhead would otherwise dominate a 5 us
kernel) that cycles through enough copies of the weight to overflow the L2 cache, so every call
reads its weight from HBM as in a real decode step. The autotuner's pick and its timing of every
candidate config go to the JSON (what the config list in kernels/w8a16.py is chosen from).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.bloom import BloomShape
from ..model.kernels import tuning
from ..model.kernels.tuning import attention_splits, sm_count
from ..model.sharding import shard_specs
from .randmodel import SHAPES as ARCHS
from .report import machine, md_table, measure_ceilings, save_result

# The W8A16 matmuls of a BLOOM layer: checkpoint name -> (short name, epilogue fused into it)
MATRICES = {
    "self_attention.query_key_value": ("qkv", ""),
    "self_attention.dense": ("dense", "residual"),
    "mlp.dense_h_to_4h": ("fc1", "gelu"),
    "mlp.dense_4h_to_h": ("fc2", "residual"),
}
DEFAULT_MODELS = "bloom-7b1,bloom-176b:8"


def model_shapes(model: str, tp: int = 1) -> dict[str, tuple[int, int, str]]:
    """The W8A16 launches of one tensor-parallel rank of a BLOOM, as the loader shards it:
    name -> (N = out features, K = in features, fused epilogue), e.g. '176b/8 qkv' -> (5376,
    14336, ''); the int8 LM head last. `model`: a shape of `mpinfer bench gpu` (bloom-560m,
    bloom-7b1, bloom-176b) or a config.json (or the folder that holds one)."""
    if model in ARCHS:
        shape, label = ARCHS[model], model.removeprefix("bloom-")
    else:
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{model!r} is neither a known shape ({', '.join(ARCHS)}) nor a "
                             "config.json or a folder holding one")  # fmt: skip
        shape, label = BloomShape.from_config(json.loads(path.read_text())), path.parent.name
    shape.check_tp(tp)
    prefix = label if tp == 1 else f"{label}/{tp}"
    out = {}
    for spec in shard_specs(dataclasses.replace(shape, n_layer=1), tp, quantize=True,
                            quantize_embeddings=True):  # fmt: skip
        matrix = spec.name.removeprefix("h.0.").removesuffix(".weight")
        if matrix in MATRICES:
            short, epilogue = MATRICES[matrix]
            out[f"{prefix} {short}"] = (*spec.rank_shape(tp), epilogue)
    out[f"{prefix} lm_head"] = (shape.vocab_per_rank(tp), shape.hidden_size, "")
    return out


def models_shapes(models: str) -> dict[str, tuple[int, int, str]]:
    """model_shapes of a comma list of MODEL[:TP] (e.g. 'bloom-7b1,bloom-176b:8')."""
    out = {}
    for item in filter(None, models.split(",")):
        model, _, tp = item.partition(":")
        if tp and not (tp.isdigit() and int(tp) > 0):
            raise ValueError(f"{item!r}: the tensor-parallel size after ':' must be a positive "
                             "integer")  # fmt: skip
        out.update(model_shapes(model, int(tp or 1)))
    return out


def graph_time_us(make_call, copies: int, calls: int = 24, reps: int = 10) -> float:
    """Microseconds per call of make_call(i) (i picks the weight copy), from a CUDA graph."""
    for i in range(copies):  # warm-up: autotuning and compilation happen outside the capture
        make_call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            make_call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def config_text(cfg) -> str:
    return tuning.name(cfg.kwargs, cfg.num_warps, cfg.num_stages)


def _copies(read_bytes: int, l2_bytes: int) -> int:
    """How many copies of what a call reads make a graph that cycles through them miss L2."""
    return max(2, -(-3 * l2_bytes // read_bytes))


def _operands(name, N, K, epilogue, M, dtype, copies):
    """Random operands of one matmul of the model: `copies` int8 weights, the LM head without a
    bias, a residual for the layers that fuse one."""
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    qs = [torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda", generator=g)
          for _ in range(copies)]  # fmt: skip
    scale = torch.rand(N, device="cuda", generator=g) / 1000
    x = torch.randn(M, K, device="cuda", generator=g, dtype=dtype)
    bias = None if name.endswith("lm_head") else torch.randn(N, device="cuda", dtype=dtype)
    res = torch.randn(M, N, device="cuda", dtype=dtype) if epilogue == "residual" else None
    return g, qs, scale, x, bias, res


def bench_shape(name, N, K, epilogue, M, dtype, l2_bytes) -> dict:
    from ..model.kernels import w8a16  # Triton: GPU only

    g, qs, scale, x, bias, res = _operands(name, N, K, epilogue, M, dtype, _copies(N * K, l2_bytes))
    gelu = epilogue == "gelu"
    w_bytes = N * K

    def ours(i):
        return w8a16.w8a16_matmul(x, qs[i], scale, bias, gelu=gelu, residual=res)

    ours(0)  # the table's config, or autotuning
    dt = tuning.dtype_name(dtype)
    tuned = w8a16._table_config(torch.cuda.current_device(), dt, M, N, K)  # as the launch did
    if tuned:
        best, timings = f"{tuned} (table)", []
    else:
        tuner = w8a16._w8a16_kernel
        timings = sorted(
            ((config_text(c), t[0] if isinstance(t, list) else t)
             for c, t in getattr(tuner, "configs_timings", {}).items()),
            key=lambda ct: ct[1],
        )  # fmt: skip
        best = config_text(tuner.best_config)
    us = graph_time_us(ours, len(qs))
    qs.clear()  # free the int8 copies before the fp16 ones
    ws = [torch.randn(N, K, device="cuda", generator=g, dtype=dtype)
          for _ in range(_copies(2 * w_bytes, l2_bytes))]  # fmt: skip

    def cublas(i):
        y = F.linear(x, ws[i], bias)
        if gelu:
            y = F.gelu(y, approximate="tanh")
        return y + res if res is not None else y

    us16 = graph_time_us(cublas, len(ws))
    ws.clear()
    torch.cuda.empty_cache()
    return {
        "shape": name, "N": N, "K": K, "M": M, "dtype": dt,
        "epilogue": epilogue or "bias",
        "int8_us": us, "int8_GBps": (w_bytes + 4 * N) / us / 1e3,
        "fp16_us": us16, "fp16_GBps": 2 * w_bytes / us16 / 1e3,
        "config": best, "autotune_ms": timings,
    }  # fmt: skip


def _compile(task) -> str | None:
    """Worker process: compile one kernel variant by launching it once on empty operands (the
    binary lands in Triton's on-disk cache, where the tuning process finds it). None, or why
    the variant cannot run."""
    name, N, K, epilogue, M, dtype, config = task
    from ..model.kernels import w8a16  # Triton: GPU only

    _, (q,), scale, x, bias, res = _operands(name, N, K, epilogue, M, getattr(torch, dtype), 1)
    try:
        w8a16.w8a16_matmul(x, q, scale, bias, gelu=epilogue == "gelu", residual=res,
                           config=config)  # fmt: skip
        torch.cuda.synchronize()
    except Exception as e:  # e.g. a tile that needs more shared memory than the GPU has
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def tune(shapes: dict, keys: list, l2_bytes: int, table_path: str, vs_autotune: bool) -> dict:
    """Time every legal sweep config (tuning.SWEEP_FAMILIES x SWEEP_SPLITS) of each launch in a
    CUDA graph with the weight from HBM, re-time the five fastest and the autotuner's pick four
    times more (interleaved), keep the lowest median; write the winners as the GPU's table.
    shapes: name -> (N, K, epilogue) as model_shapes gives; keys: (shape name, M, dtype)
    triples. The table is rewritten after every key, so a run that runs out of time keeps what
    it finished."""
    gpu = torch.cuda.get_device_name()
    t0 = time.time()
    plan = []
    for shape, M, dtype in keys:
        N, K, epi = shapes[shape]
        dt = tuning.dtype_name(dtype)
        cands = [c for c in tuning.names(tuning.SWEEP_FAMILIES, tuning.SWEEP_SPLITS, dt)
                 if not tuning.illegal(c, M, N, K, dt)]  # fmt: skip
        plan.append((shape, N, K, epi, M, dtype, dt, cands))
    # Compile every variant in parallel first (one per family, row count, dtype and epilogue:
    # the split is a runtime argument, and N and K only matter through K % BLOCK_K).
    variants = {}
    for shape, N, K, epi, M, _, dt, cands in plan:
        for c in cands:
            variants.setdefault(_variant(shape, K, epi, M, dt, c), (shape, N, K, epi, M, dt, c))
    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = pool.map(_compile, list(variants.values()), chunksize=1)
    broken = {v: err for v, err in zip(variants, errors) if err}  # variant -> why
    print(f"compiled {len(variants)} variants with {workers} processes in "
          f"{time.time() - t0:.0f} s; {len(broken)} cannot run", flush=True)  # fmt: skip

    table = {"gpu": gpu, "triton": __import__("triton").__version__, "torch": torch.__version__,
             "measured_by": "mpinfer bench kernels --tune", "configs": {}}  # fmt: skip
    if Path(table_path).exists():  # a partial re-tune keeps the table's other launches
        old = json.loads(Path(table_path).read_text())
        if old.get("gpu") == gpu:
            table["configs"].update(old["configs"])
    rows = []
    for shape, N, K, epi, M, dtype, dt, cands in plan:
        runnable = [c for c in cands if _variant(shape, K, epi, M, dt, c) not in broken]
        row = _tune_launch(shape, N, K, epi, M, dtype, dt, runnable, l2_bytes, vs_autotune)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if "_us" not in k or k == "autotune_us"}),
              flush=True)  # fmt: skip
        table["configs"][row["key"]] = row["config"]
        Path(table_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(table_path).with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, table_path)
    return {"gpu": gpu, "table": table_path, "seconds": time.time() - t0,
            "broken": {str(k): v for k, v in broken.items()}, "rows": rows}  # fmt: skip


def _variant(shape, K, epi, M, dt, config) -> tuple:
    """What a compiled kernel depends on: everything but the split (a runtime argument); N and
    K only through K % BLOCK_K (all the shapes' N and K are multiples of 16)."""

    kw, w, st = tuning.parse(config)
    family = (kw["USE_DOT"], kw["SWAP"], kw["BLOCK_N"], kw["BLOCK_K"], kw["PREFETCH"],
              kw["MAGIC"], w, st, K % kw["BLOCK_K"] == 0)  # fmt: skip
    return (dt, M, epi, shape.endswith("lm_head"), family)


def _tune_launch(shape, N, K, epi, M, dtype, dt, cands, l2_bytes, vs_autotune) -> dict:
    from ..model.kernels import w8a16  # Triton: GPU only

    _, qs, scale, x, bias, res = _operands(shape, N, K, epi, M, dtype, _copies(N * K, l2_bytes))
    gelu = epi == "gelu"
    calls = max(len(qs), min(24, int(2e3 / (N * K / 3e6))))  # about 2 ms of graph

    def timed(config):
        def call(i):
            return w8a16.w8a16_matmul(x, qs[i], scale, bias, gelu=gelu, residual=res,
                                      config=config)  # fmt: skip

        return graph_time_us(call, len(qs), calls=calls, reps=3)

    if not cands:
        raise RuntimeError(f"no W8A16 config can run {shape} at {M} rows in {dtype}")
    first = {c: timed(c) for c in cands}
    picked = None
    if vs_autotune:
        w8a16.w8a16_matmul(x, qs[0], scale, bias, gelu=gelu, residual=res, config="autotune")
        picked = config_text(w8a16._w8a16_kernel.best_config)
    leaders = sorted(first, key=first.get)[:5]
    if picked and picked not in leaders:
        leaders.append(picked)
    again = {c: [first[c] if c in first else timed(c)] for c in leaders}
    for _ in range(4):  # interleaved, so a slow spell of the GPU hits every leader alike
        for c in leaders:
            again[c].append(timed(c))
    final = {c: statistics.median(v) for c, v in again.items()}
    best = min(final, key=final.get)
    qs.clear()
    torch.cuda.empty_cache()
    return {"key": tuning.key(dt, M, N, K), "shape": shape, "N": N, "K": K, "M": M, "dtype": dt,
            "config": best, "us": final[best], "GBps": (N * K + 4 * N) / final[best] / 1e3,
            "autotune_config": picked, "autotune_us": final.get(picked),
            "best_us_by_magic": {str(m): min((t for c, t in first.items()
                                              if tuning.parse(c)[0]["MAGIC"] == m), default=None)
                                 for m in tuning.magics(dt)},  # fmt: skip
            "leaders_us": again,
            "candidates_us": sorted(first.items(), key=lambda cu: cu[1])}  # fmt: skip


def tune_markdown(result: dict) -> str:
    def by_magic(r, m):
        t = r.get("best_us_by_magic", {}).get(str(m))
        return f"{t:.1f}" if t else "-"

    header = ["shape", "rows", "dtype", "table config", "us", "GB/s", "autotuner's pick", "us",
              "gain", "best magic0 / 1 / 2 us"]  # fmt: skip
    rows = [[r["shape"], r["M"], r["dtype"], r["config"], f"{r['us']:.1f}", f"{r['GBps']:.0f}",
             r["autotune_config"] or "-",
             f"{r['autotune_us']:.1f}" if r["autotune_us"] else "-",
             f"{r['autotune_us'] / r['us']:.2f}x" if r["autotune_us"] else "-",
             " / ".join(by_magic(r, m) for m in (0, 1, 2))]
            for r in result["rows"]]  # fmt: skip
    return (
        f"{result['gpu']}: the tuned table ({result['table']}), timed in a CUDA graph with "
        "weights from HBM (median of 5), beside the autotuner's pick where it was timed too, "
        "and the fastest config of each int8 conversion (magic0: via fp32, 1: the fp16 bit "
        "trick in Triton ops, 2: the bit trick in packed PTX; one timing each)\n\n"
        + md_table(header, rows)
    )


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
    copies = _copies(read, l2_bytes)
    caches = [(torch.randn(B, heads, max_seq, head_dim, device="cuda", dtype=dtype),
               torch.randn(B, heads, max_seq, head_dim, device="cuda", dtype=dtype))
              for _ in range(copies)]  # fmt: skip
    qkv = torch.randn(B, heads * 3 * head_dim, device="cuda", dtype=dtype)
    slots = torch.arange(B, device="cuda")
    pos = torch.full((B,), context, device="cuda")
    vf = torch.zeros(B, dtype=torch.long, device="cuda")
    slopes = torch.rand(heads, device="cuda")
    policy = attention_splits(B, heads, max_seq, sms)
    splits = sorted({policy, 1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 18, 24, 32}
                    | {max(1, -(-f * sms // (B * heads))) for f in (2, 4, 8, 16)})  # fmt: skip
    results = []
    grid = itertools.product((32, 64), (2, 4), (3,), splits)
    for block_l, warps, stages, n in grid:

        def call(i, block_l=block_l, warps=warps, stages=stages, n=n):
            k, v = caches[i]
            return attention.decode_attention(qkv, k, v, slots, pos, vf, slopes, n_splits=n,
                                              block_l=block_l, num_warps=warps,
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


def markdown(result: dict) -> str:
    bw = result["copy_bandwidth_GBps"]
    header = ["shape", "N x K", "rows", "dtype", "int8 us", "int8 GB/s", "% of copy", "fp16 us",
              "fp16 GB/s", "int8 speed-up", "config"]  # fmt: skip
    rows = [[r["shape"], f"{r['N']} x {r['K']}", r["M"], r["dtype"], f"{r['int8_us']:.1f}",
             f"{r['int8_GBps']:.0f}", f"{100 * r['int8_GBps'] / bw:.0f}", f"{r['fp16_us']:.1f}",
             f"{r['fp16_GBps']:.0f}", f"{r['fp16_us'] / r['int8_us']:.2f}", r["config"]]
            for r in result["rows"]]  # fmt: skip
    return (
        f"{result['gpu']}: copy {bw / 1e3:.2f} TB/s. W8A16 decode matmul (fused epilogue) vs "
        "cuBLAS fp16 (+ separate epilogue ops), each in a CUDA graph, weights from HBM\n\n"
        + md_table(header, rows)
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help="comma list of MODEL[:TP] whose per-rank matmuls to run: bloom-560m, "
                   "bloom-7b1, bloom-176b or a config.json (or its folder); TP 1 if not "
                   "given")  # fmt: skip
    p.add_argument("--shapes", default="",
                   help="comma list of the models' matmuls to keep (e.g. '7b1 qkv,176b/8 fc1'); "
                   "all by default")  # fmt: skip
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--bf16-rows", default="1", help="rows also measured in bf16 ('' for none)")
    p.add_argument("--out", default="bench/results/kernels.json")
    p.add_argument("--tune", metavar="TABLE", help="sweep every config of each launch and write "
                   "the winners as this GPU's table (mpinfer/kernels/tuned/<gpu>.json to ship "
                   "it) instead of the comparison with cuBLAS")  # fmt: skip
    p.add_argument("--vs-autotune", action="store_true",
                   help="with --tune: also time the autotuner's pick of each launch")  # fmt: skip
    p.add_argument("--attention", action="store_true",
                   help="sweep the decode attention's tiles, warps, stages and splits")  # fmt: skip
    a = p.parse_args(argv)
    try:
        shapes = models_shapes(a.models)
    except ValueError as e:
        p.error(f"--models: {e}")
    names = [n for n in a.shapes.split(",") if n] or list(shapes)
    for name in names:
        if name not in shapes:
            p.error(f"--shapes: {name!r} is not a matmul of {a.models}; they are {list(shapes)}")
    if not torch.cuda.is_available():
        print("error: `mpinfer bench kernels` needs a CUDA GPU")
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 64 << 20)
    rows = []
    runs = [(int(m), torch.float16) for m in a.rows.split(",") if m]
    runs += [(int(m), torch.bfloat16) for m in a.bf16_rows.split(",") if m]
    if a.attention:
        ceil = measure_ceilings()
        result = {"machine": machine(), **ceil, **attention_sweep(512, [576, 2048], l2)}
        save_result(result, a.out, attention_markdown(result, ceil["copy_bandwidth_GBps"]))
        return 0
    if a.tune:
        keys = [(name, M, dt) for M, dt in runs for name in names]
        result = {"machine": machine(), **tune(shapes, keys, l2, a.tune, a.vs_autotune)}
        save_result(result, a.out, tune_markdown(result))
        return 0
    ceil = measure_ceilings()
    for name in names:
        N, K, epi = shapes[name]
        for M, dtype in runs:
            r = bench_shape(name, N, K, epi, M, dtype, l2)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "autotune_ms"}), flush=True)
    result = {"machine": machine(), "gpu": props.name, **ceil, "rows": rows}
    save_result(result, a.out, markdown(result))
    return 0
