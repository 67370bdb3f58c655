"""One launch of each weight-only matmul config (and cuBLAS fp16 on the same shape) inside a
profiler range, for Nsight Compute to read the hardware counters of (GPU only):

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats ... \\
        python -m mpinfer.tools.diag.matmul_profile --shape 43008x14336 --rows 1 \\
        --bits 4 "fma n64 k128 split8 pf1 magic5 w4 s3" "swap n256 k128 split8 pf0 magic7 w8 s3"

Each config runs twice before the range (compiled), then once inside it (ncu empties the caches
before each profiled kernel by default); cuBLAS runs on an fp16 weight of the same shape.
--lines (int4): each config with half-line and with whole-line loads (w4a16.LINES);
--read n32 k256 split6: also a plain read of the same weight bytes walked in those tiles
(common.read_tiles: the loads alone), to set the loop's counters beside a read's.
`scripts/gpu_check.sh ncu` runs it under ncu with the sections that say where a loop stalls
(issue slots, warp states, memory throughput).
"""

from __future__ import annotations

import argparse

import torch

from ...model.kernels import w4a16, w8a16
from ...model.quant import quantize_int4, quantize_rows
from .common import read_tiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help="config names (tuning.py)")
    ap.add_argument("--shape", default="12288x4096", help="N x K: out x in features")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    ap.add_argument("--no-cublas", action="store_true")
    ap.add_argument("--lines", action="store_true", help="int4: half and whole-line loads")
    ap.add_argument("--read", default="", help='a tiled read, e.g. "n32 k256 split6"')
    a = ap.parse_args()
    N, K = (int(v) for v in a.shape.split("x"))
    dev = torch.device("cuda")

    def weights():
        w = torch.randn(N, K, device=dev) * 0.02
        if a.bits == 8:
            q, s = quantize_rows(w)
            return lambda x, cfg, lines=None: w8a16.w8a16_matmul(x, q, s, None, config=cfg)
        p, s, z = quantize_int4(w, 128)
        if a.read:  # the same bytes, read alone in the matmul's tiles
            bn, bk, split = (int(v[1:]) for v in a.read.replace("split", "s").split())
            out = torch.empty(N // bn * split, dtype=torch.int32, device=dev)
            rows = p.view(torch.int8)
            reads.append((f"read {a.read}", lambda x, cfg: read_tiles[(N // bn, split)](
                rows, out, K // 2, split, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)))  # fmt: skip
        return lambda x, cfg, lines=None: w4a16.w4a16_matmul(x, p, s, z, None, config=cfg,
                                                             lines=lines)  # fmt: skip

    x = torch.randn(a.rows, K, device=dev, dtype=torch.float16)
    reads = []
    loads = [False, True] if a.lines else [None]  # whole lines or not (None: the default)
    assert a.bits == 4 or (loads == [None] and not a.read), "--lines, --read: int4 only"
    runs = []
    for cfg in a.configs:
        fn = weights()
        runs += [(cfg if f is None else f"{cfg} {'whole' if f else 'half'} lines",
                  lambda x, _, fn=fn, cfg=cfg, f=f: fn(x, cfg, f)) for f in loads]  # fmt: skip
    runs += reads[:1]
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
