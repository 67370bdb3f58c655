"""The one-row W8A16 launches of bloom-7b1 and the 176B tp-8 rank: the tuned table's config
against the one-row (fma) loop's configs, each timed as `mpinfer bench kernels` times them (CUDA
graph, weights from HBM, the model's epilogue). Run once per kernel variant under test, e.g.
MPINFER_X2D=0 and =1.  python3 diag/fma_ab.py OUT.json"""

import json
import os
import sys

import torch

from mpinfer.kernelbench import _copies, _operands, graph_time_us, models_shapes
from mpinfer.kernels import tuning, w8a16

FMA = [
    "fma n16 k256 split1 pf0 magic2 w4 s3",
    "fma n16 k256 split2 pf0 magic2 w4 s3",
    "fma n16 k256 split3 pf0 magic2 w4 s3",
    "fma n8 k512 split1 pf1 magic2 w4 s1",
    "fma n16 k512 split1 pf1 magic2 w4 s1",
    "fma n8 k256 split2 pf0 magic2 w4 s3",
]
l2 = torch.cuda.get_device_properties(0).L2_cache_size
rows = []
for dtype in [getattr(torch, d) for d in os.environ.get("DTYPES", "float16").split(",")]:
    dt = tuning.dtype_name(dtype)
    for name, (N, K, epi) in models_shapes("bloom-7b1,bloom-176b:8").items():
        if name.endswith("lm_head"):
            continue
        _, qs, scale, x, bias, res = _operands(name, N, K, epi, 1, dtype, _copies(N * K, l2))
        table = w8a16._table_config(0, dt, 1, N, K)
        times = {}
        for config in [table] + [c for c in FMA if c != table]:
            if tuning.illegal(config, 1, N, K, dt):
                continue

            def call(i, c=config, x=x, qs=qs, s=scale, b=bias, g=epi == "gelu", r=res):
                return w8a16.w8a16_matmul(x, qs[i], s, b, gelu=g, residual=r, config=c)

            times[config] = min(graph_time_us(call, len(qs), reps=3) for _ in range(3))
        best = min(times, key=times.get)
        rows.append({"shape": name, "dtype": dt, "table": table, "table_us": times[table],
                     "best": best, "best_us": times[best], "all": times})  # fmt: skip
        print(f"| {name} | {dt} | {table} | {times[table]:.1f} | {best} | {times[best]:.1f} |",
              flush=True)  # fmt: skip
        qs.clear()
        torch.cuda.empty_cache()
json.dump({"X2D": os.environ.get("MPINFER_X2D", "1"), "rows": rows}, open(sys.argv[1], "w"))
