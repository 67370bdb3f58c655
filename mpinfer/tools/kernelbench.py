"""`mpinfer bench kernels`: the weight-only matmuls alone, per weight shape of bloom-7b1 and of
one BLOOM-176B tp-8 rank, at every row count a step has (1, 16, 64 decode rows; 128, 256, 576
tokens of a mixed step): mpinfer's W8A16 and W4A16 kernels against cuBLAS fp16 on the same
shape, against the device-to-device copy bandwidth measured in the same run, and beside the
other libraries' kernels that install from the registries (kernelcands.py), where they import.

Each kernel is timed inside a CUDA graph (launch overhead would otherwise dominate a 5 us
kernel) that cycles through enough copies of the weight to overflow the L2 cache, so every call
reads its weight from HBM as in a real decode step. `--tune` sweeps every legal config of each
launch instead and writes the winners into the GPU's table (tuning.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.bloom import BloomShape
from ..model.kernels import tuning
from ..model.sharding import shard_specs
from . import kernelcands
from .attnbench import attention_markdown, attention_sweep
from .kernelcands import CANDIDATES
from .randmodel import SHAPES as ARCHS
from .report import graph_time_us, l2_copies, machine, md_table, measure_ceilings, save_result
from .tunebench import operands, quant_bytes, run_quant, tune, tune_markdown

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
    for spec in shard_specs(dataclasses.replace(shape, n_layer=1), tp, embeddings="int8"):
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


def runs_as(name: str, rows: int, bits: int) -> bool:
    """Whether the model ever launches this matmul with this many rows and bits: the LM head
    runs the rows that sample (at most the slots) or 64 prompt positions at a time, and its
    weight is the embedding's, which is int8 or the compute dtype, never int4."""
    return not name.endswith("lm_head") or (bits == 8 and rows <= tuning.SINGLE_TILE)


def config_text(cfg) -> str:
    return tuning.name(cfg.kwargs, cfg.num_warps, cfg.num_stages)


def chosen_config(x, N, K, bits, group) -> str:
    from ..model.kernels import launch

    return launch._chosen(torch.cuda.current_device(), tuning.dtype_name(x.dtype), x.shape[0],
                            N, K, bits, group if bits == 4 else 0)  # fmt: skip


def bench_shape(name, N, K, epi, M, dtype, l2_bytes, *, bits: int = 8, group: int = 128,
                candidates: tuple = ()) -> dict:  # fmt: skip
    w_bytes = quant_bytes(N, K, bits, group)
    g, ws, x, bias, res = operands(name, N, K, epi, M, dtype, l2_copies(w_bytes, l2_bytes), bits,
                                    group)  # fmt: skip
    gelu = epi == "gelu"

    def ours(i):
        return run_quant(bits, x, ws[i], bias, gelu=gelu, residual=res)

    config = chosen_config(x, N, K, bits, group)
    us = graph_time_us(ours, len(ws))
    ws.clear()  # free the quantized copies before the fp16 ones
    w16 = [torch.randn(N, K, device="cuda", generator=g, dtype=dtype)
           for _ in range(l2_copies(2 * N * K, l2_bytes))]  # fmt: skip

    def cublas(i):
        y = F.linear(x, w16[i], bias)
        if gelu:
            y = F.gelu(y, approximate="tanh")
        return y + res if res is not None else y

    us16 = graph_time_us(cublas, len(w16))
    cands = {}
    for cand in candidates:  # the same launch through each library that installs here
        copies = l2_copies(quant_bytes(N, K, bits, group), l2_bytes)
        cands[cand] = kernelcands.time_candidate(cand, w16[0], bias, x, group, copies,
                                                 graph_time_us)  # fmt: skip
    w16.clear()
    torch.cuda.empty_cache()
    return {
        "shape": name, "N": N, "K": K, "M": M, "dtype": tuning.dtype_name(dtype),
        "quant": f"int{bits}", "epilogue": epi or "bias", "us": us, "GBps": w_bytes / us / 1e3,
        "fp16_us": us16, "fp16_GBps": 2 * N * K / us16 / 1e3, "vs_fp16": us / us16,
        "config": config, "candidates_us": cands,
    }  # fmt: skip


def markdown(result: dict) -> str:
    bw = result["copy_bandwidth_GBps"]
    cands = sorted({c for r in result["rows"] for c in r.get("candidates_us", {})})
    header = ["shape", "N x K", "rows", "dtype", "quant", "us", "GB/s", "% of copy", "fp16 us",
              "us / fp16", "config", *[f"{c} us" for c in cands]]  # fmt: skip

    def cand(r, c):
        t = r.get("candidates_us", {}).get(c)
        return f"{t:.1f}" if isinstance(t, float) else (t or "-")[:40]

    rows = [[r["shape"], f"{r['N']} x {r['K']}", r["M"], r["dtype"], r["quant"], f"{r['us']:.1f}",
             f"{r['GBps']:.0f}", f"{100 * r['GBps'] / bw:.0f}", f"{r['fp16_us']:.1f}",
             f"{r['vs_fp16']:.2f}", r["config"], *[cand(r, c) for c in cands]]
            for r in result["rows"]]  # fmt: skip
    return (
        f"{result['gpu']}: copy {bw / 1e3:.2f} TB/s. mpinfer's weight-only matmuls (fused "
        "epilogue) vs cuBLAS fp16 (+ separate epilogue ops) and the libraries that installed, "
        "each in a CUDA graph, weights from HBM\n\n" + md_table(header, rows)
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
    p.add_argument("--rows", default="1,16,64,128,256,576")
    p.add_argument("--bf16-rows", default="", help="rows also measured in bf16 ('' for none)")
    p.add_argument("--quant", default="int8,int4", help="comma list of int8, int4")
    p.add_argument("--group-size", type=int, default=128, help="int4's group size")
    p.add_argument("--candidates", default="",
                   help=f"comma list of other libraries' kernels to time beside ours where they "
                   f"import: {', '.join(CANDIDATES)} ('all': every one)")  # fmt: skip
    p.add_argument("--candidate-rows", default="1,16,64,128,256,576",
                   help="the row counts the candidates are timed at")  # fmt: skip
    p.add_argument("--candidate-shapes", default="",
                   help="the matmuls the candidates are timed on (default: all)")  # fmt: skip
    p.add_argument("--out", default="bench/results/kernels.json")
    p.add_argument("--tune", metavar="TABLE", help="sweep every config of each launch and write "
                   "the winners into this GPU's table (mpinfer/model/kernels/tuned/<gpu>.json "
                   "to ship it) instead of the comparison with cuBLAS")  # fmt: skip
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
    bits = [{"int8": 8, "int4": 4}[q] for q in a.quant.split(",") if q]
    if a.tune:
        result = {"machine": machine(), "sweeps": []}
        for b in bits:
            keys = [(name, M, dt) for M, dt in runs for name in names if runs_as(name, M, b)]
            result["sweeps"].append(tune(shapes, keys, l2, a.tune, bits=b, group=a.group_size))
        result["rows"] = [r for sw in result["sweeps"] for r in sw["rows"]]
        result.update(gpu=props.name, table=a.tune)
        save_result(result, a.out, tune_markdown(result))
        return 0
    cands = (
        tuple(CANDIDATES) if a.candidates == "all" else tuple(filter(None, a.candidates.split(",")))
    )
    ceil = measure_ceilings()
    for name in names:
        N, K, epi = shapes[name]
        for M, dtype in runs:
            timed = str(M) in a.candidate_rows.split(",") and (
                not a.candidate_shapes or name in a.candidate_shapes.split(",")
            )
            for b in [b for b in bits if runs_as(name, M, b)]:
                r = bench_shape(
                    name,
                    N,
                    K,
                    epi,
                    M,
                    dtype,
                    l2,
                    bits=b,
                    group=a.group_size,
                    candidates=tuple(c for c in cands if CANDIDATES[c] == b) if timed else (),
                )
                rows.append(r)
                print(json.dumps(r), flush=True)
    result = {"machine": machine(), "gpu": props.name, **ceil, "rows": rows}
    save_result(result, a.out, markdown(result))
    return 0
