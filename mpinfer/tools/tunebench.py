"""`mpinfer bench kernels --tune`: the sweep behind a GPU's kernel table (tuning.py), and the
operands it shares with kernelbench.py. Every legal config of each launch is timed as the model
runs it (a CUDA graph cycling through enough weight copies to miss L2), the leaders are re-timed
interleaved, and the fastest whose output matches the reference wins. What is not here: the
comparison with cuBLAS and the other libraries (kernelbench.py), the table's format and lookup
(tuning.py).

Every leader is checked against the pure-torch reference on the launch's own operands before
it can win (the largest error over the largest output under 1e-2, as tests/test_gpu.py's family
test asks), twice: a config that is fast because it is wrong, or whose sums change from call to
call, is dropped and named in the result instead of shipped.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.kernels import epilogue, tuning
from ..model.kernels.tuning import sm_count
from ..model.quant import dequantize_int4, int8_linear_reference
from .report import graph_time_us, l2_copies, md_table


def operands(name, N, K, epilogue, M, dtype, copies, bits: int = 8, group: int = 128):
    """Random operands of one matmul of the model: `copies` quantized weights (int8 rows and
    their scales, or packed int4 with group scales and offsets), the LM head without a bias, a
    residual for the layers that fuse one."""
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    if bits == 8:
        ws = [(torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda", generator=g),
               torch.rand(N, device="cuda", generator=g) / 1000)
              for _ in range(copies)]  # fmt: skip
    else:
        ws = [(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda", generator=g),
               (torch.rand(K // group, N, device="cuda", generator=g) / 100).half(),
               (torch.rand(K // group, N, device="cuda", generator=g) / -10).half())
              for _ in range(copies)]  # fmt: skip
    x = torch.randn(M, K, device="cuda", generator=g, dtype=dtype)
    bias = None if name.endswith("lm_head") else torch.randn(N, device="cuda", dtype=dtype)
    res = torch.randn(M, N, device="cuda", dtype=dtype) if epilogue == "residual" else None
    return g, ws, x, bias, res


def quant_bytes(N: int, K: int, bits: int, group: int = 128) -> int:
    """What a quantized matmul reads of its weight: int8 and a row scale, or int4 and a group's
    fp16 scale and offset."""
    return N * K + 4 * N if bits == 8 else N * K // 2 + 4 * N * (K // group)


def run_quant(bits, x, w, bias, *, gelu=False, residual=None, config=None):
    """One launch of mpinfer's kernel of `bits` on a weight `w` as `_operands` makes them."""
    from ..model.kernels import w4a16, w8a16  # Triton: GPU only

    if bits == 8:
        return w8a16.w8a16_matmul(x, *w, bias, gelu=gelu, residual=residual, config=config)
    return w4a16.w4a16_matmul(x, *w, bias, gelu=gelu, residual=residual, config=config)


# A leader's largest error over the reference's largest output, at most (tests/test_gpu.py)
MAX_ERROR = 1e-2


def reference(bits, x, w, bias, *, gelu=False, residual=None) -> torch.Tensor:
    """The launch in fp32 through the model's pure-torch paths (quant.py: the int8 reference
    matmul, or the int4 weight dequantized), then the kernels' epilogue."""
    xf, bf = x.float(), bias.float() if bias is not None else None
    if bits == 8:
        y = int8_linear_reference(xf, *w, bf)
    else:
        y = F.linear(xf, dequantize_int4(*w), bf)
    return epilogue(y, gelu=gelu, residual=residual.float() if residual is not None else None)


def _compile(task) -> str | None:
    """Worker process: compile one kernel variant by launching it once on random operands (the
    binary lands in Triton's on-disk cache, where the tuning process finds it). None, or why
    the variant cannot run."""
    name, N, K, epilogue, M, dtype, config, bits, group = task
    _, (w,), x, bias, res = operands(name, N, K, epilogue, M, getattr(torch, dtype), 1, bits,
                                      group)  # fmt: skip
    from ..model.kernels import w8a16_tma

    unbuilt = len(w8a16_tma.TMA_UNBUILT)
    try:
        run_quant(bits, x, w, bias, gelu=epilogue == "gelu", residual=res, config=config)
        torch.cuda.synchronize()
    except Exception as e:  # e.g. a tile that needs more shared memory than the GPU has
        return f"{type(e).__name__}: {str(e)[:200]}"
    if len(w8a16_tma.TMA_UNBUILT) > unbuilt:  # it ran as the swap loop: not the config it names
        return f"tma does not build here: {list(w8a16_tma.TMA_UNBUILT.values())[-1]}"
    return None


def tune(shapes: dict, keys: list, l2_bytes: int, table_path: str, *, bits: int = 8,
         group: int = 128) -> dict:  # fmt: skip
    """Time every legal sweep config (tuning.candidates) of each launch in a CUDA graph with the
    weight from HBM, re-time the five fastest and the default rule's pick four times more
    (interleaved), keep the lowest median; write the winners into the GPU's table. shapes:
    name -> (N, K, epilogue) as model_shapes gives; keys: (shape name, M, dtype) triples. The
    table is rewritten after every key, so a run that runs out of time keeps what it finished."""
    gpu = torch.cuda.get_device_name()
    t0 = time.time()
    grp = group if bits == 4 else 0
    plan = []
    for shape, M, dtype in keys:
        N, K, epi = shapes[shape]
        dt = tuning.dtype_name(dtype)
        cands = [c for c in tuning.candidates(tuning.row_bucket(M), dt, bits=bits, group=group)
                 if not tuning.illegal(c, M, N, K, dt, bits=bits, group=grp)]  # fmt: skip
        plan.append((shape, N, K, epi, M, dtype, dt, cands))
    # Compile every variant in parallel first (one per family, row tile, dtype and epilogue:
    # the split is a runtime argument, and N and K only matter through K % BLOCK_K).
    variants = {}
    for shape, N, K, epi, M, _, dt, cands in plan:
        for c in cands:
            variants.setdefault(_variant(shape, K, epi, M, dt, c),
                                (shape, N, K, epi, M, dt, c, bits, group))  # fmt: skip
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
            for field in tuning.CROSSOVERS.values():  # measured by served mixes, not here
                if field in old:
                    table[field] = old[field]
    rows = []
    for shape, N, K, epi, M, dtype, dt, cands in plan:
        runnable = [c for c in cands if _variant(shape, K, epi, M, dt, c) not in broken]
        row = _tune_launch(shape, N, K, epi, M, dtype, dt, runnable, l2_bytes, bits, group)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("leaders_us",
                                                                    "candidates_us")}),
              flush=True)  # fmt: skip
        table["configs"][row["key"]] = row["config"]
        Path(table_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(table_path).with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, table_path)
    return {"gpu": gpu, "table": table_path, "seconds": time.time() - t0,
            "broken": {str(k): v for k, v in broken.items()}, "rows": rows}  # fmt: skip


def _variant(shape, K, epi, M, dt, config) -> tuple:
    """What a compiled kernel depends on: everything but the split (a runtime argument; a
    `tma` config compiles apart with and without one); N and K only through K % BLOCK_K (all
    the shapes' N and K are multiples of 16)."""
    kw, w, st = tuning.parse(config)
    family = (kw["USE_DOT"], kw["SWAP"], kw["TMA"], kw["BLOCK_N"], kw["BLOCK_K"], kw["PREFETCH"],
              kw["MAGIC"], tuning.block_m(kw, M), w, st, K % kw["BLOCK_K"] == 0,
              kw["MAXNREG"], kw["TMA"] and kw["split_k"] > 1)  # fmt: skip
    return (dt, epi, shape.endswith("lm_head"), family)


def _tune_launch(shape, N, K, epi, M, dtype, dt, cands, l2_bytes, bits, group) -> dict:
    w_bytes = quant_bytes(N, K, bits, group)
    _, ws, x, bias, res = operands(shape, N, K, epi, M, dtype, l2_copies(w_bytes, l2_bytes),
                                    bits, group)  # fmt: skip
    gelu = epi == "gelu"
    work_us = max(w_bytes / 3e3, 2 * M * N * K / 6e8)  # about the launch's own time
    calls = max(len(ws), min(24, int(2e3 / work_us)))  # about 2 ms of graph

    def timed(config):
        def call(i):
            return run_quant(bits, x, ws[i], bias, gelu=gelu, residual=res, config=config)

        return graph_time_us(call, len(ws), calls=calls, reps=3)

    if not cands:
        raise RuntimeError(f"no int{bits} config can run {shape} at {M} rows in {dtype}")
    ref = reference(bits, x, ws[0], bias, gelu=gelu, residual=res)

    def error(config) -> float:
        errs = []
        for _ in range(2):  # twice: a sum that moves from call to call is wrong too
            y = run_quant(bits, x, ws[0], bias, gelu=gelu, residual=res, config=config)
            errs.append((y.float() - ref).abs().max().item())
        return max(errs) / ref.abs().max().item()

    first = {c: timed(c) for c in cands}
    picked = tuning.default_config(M, N, K, dt, sm_count(0), bits=bits,
                                   group=group if bits == 4 else 0)  # fmt: skip
    wrong, leaders = {}, []
    for c in sorted(first, key=first.get):  # the five fastest that match the reference
        if len(leaders) == 5:
            break
        err = error(c)
        if err < MAX_ERROR:
            leaders.append(c)
        else:
            wrong[c] = err
    if picked not in leaders:
        leaders.append(picked)
    again = {c: [first[c] if c in first else timed(c)] for c in leaders}
    for _ in range(4):  # interleaved, so a slow spell of the GPU hits every leader alike
        for c in leaders:
            again[c].append(timed(c))
    final = {c: statistics.median(v) for c, v in again.items() if c not in wrong}
    best = min(final, key=final.get)
    ws.clear()
    torch.cuda.empty_cache()
    grp = group if bits == 4 else 0
    return {"key": tuning.key(dt, M, N, K, bits=bits, group=grp), "shape": shape, "N": N, "K": K,
            "M": M, "dtype": dt, "quant": f"int{bits}", "config": best, "us": final[best],
            "GBps": w_bytes / final[best] / 1e3, "default_config": picked,
            "default_us": final.get(picked), "leaders_us": again, "wrong": wrong,
            "candidates_us": sorted(first.items(), key=lambda cu: cu[1])}  # fmt: skip


def tune_markdown(result: dict) -> str:
    header = ["shape", "rows", "dtype", "quant", "table config", "us", "GB/s", "default rule's",
              "us", "gain"]  # fmt: skip
    rows = [[r["shape"], r["M"], r["dtype"], r["quant"], r["config"], f"{r['us']:.1f}",
             f"{r['GBps']:.0f}", r["default_config"],
             f"{r['default_us']:.1f}" if r["default_us"] else "-",
             f"{r['default_us'] / r['us']:.2f}x" if r["default_us"] else "-"]
            for r in result["rows"]]  # fmt: skip
    return (
        f"{result['gpu']}: the tuned table ({result['table']}), timed in a CUDA graph with "
        "weights from HBM (median of 5), beside the config the default rule gives a launch no "
        "table has\n\n" + md_table(header, rows)
    )
