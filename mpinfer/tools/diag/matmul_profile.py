"""One launch of each weight-only matmul config (and cuBLAS fp16 on the same shape) inside a
profiler range, for Nsight Compute to read the hardware counters of (GPU only):

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats ... \\
        python -m mpinfer.tools.diag.matmul_profile --shape 43008x14336 --rows 1 \\
        --bits 4 "fma n64 k128 split8 pf1 magic5 w4 s3" "swap n256 k128 split8 pf0 magic7 w8 s3"

Each config runs twice before the range (compiled), then once inside it (ncu empties the caches
before each profiled kernel by default); cuBLAS runs on an fp16 weight of the same shape.
`scripts/gpu_check.sh ncu` runs it under ncu with the sections that say where a loop stalls
(issue slots, warp states, memory throughput).
"""

from __future__ import annotations

import argparse

import torch

from ...model.kernels import w4a16, w8a16
from ...model.quant import quantize_int4, quantize_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help="config names (tuning.py)")
    ap.add_argument("--shape", default="12288x4096", help="N x K: out x in features")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    ap.add_argument("--no-cublas", action="store_true")
    a = ap.parse_args()
    N, K = (int(v) for v in a.shape.split("x"))
    dev = torch.device("cuda")

    def weights():
        w = torch.randn(N, K, device=dev) * 0.02
        if a.bits == 8:
            q, s = quantize_rows(w)
            return lambda x, cfg: w8a16.w8a16_matmul(x, q, s, None, config=cfg)
        p, s, z = quantize_int4(w, 128)
        return lambda x, cfg: w4a16.w4a16_matmul(x, p, s, z, None, config=cfg)

    x = torch.randn(a.rows, K, device=dev, dtype=torch.float16)
    runs = [(cfg, weights()) for cfg in a.configs]
    w16 = None if a.no_cublas else torch.randn(N, K, device=dev, dtype=torch.float16)
    for cfg, fn in runs:
        fn(x, cfg)
        fn(x, cfg)
    if w16 is not None:
        x @ w16.T
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for cfg, fn in runs:
        fn(x, cfg)
    if w16 is not None:
        x @ w16.T
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(c for c, _ in runs) + ("" if w16 is None else ", cuBLAS fp16"))


if __name__ == "__main__":
    main()
