"""Is the decode matmul's gap to a plain read its access pattern? For each weight shape of
bloom-7b1 and the 176B tp-8 rank, in CUDA graphs cycling through weight copies past the L2:
- contiguous: N x K bytes read as one stream, an equal contiguous chunk per program;
- tiles: the same bytes read as the W8A16 kernel walks them (programs own BLOCK_N rows and a
  run of K, and step through it BLOCK_K bytes of each row at a time: rows K bytes apart), no
  arithmetic; the best of a few tilings and splits;
- the W8A16 matmul itself with its tuned config (bias, no other epilogue).
--int4: the packed int4 weights (K / 2 bytes a row) of bloom-7b1 and BLOOM-176B on one GPU,
tiles of 64-256 bytes a row an iteration (the one-row W4A16 loop's are 64 or 128: one group of
128, or two), the W4A16 matmul with its tuned config (groups of 128); then, per shape, the
one-row W4A16 launch with each config of --configs (';'-separated, "split{}" filled with 2, 3,
4 and 6: the best of them) beside the table's; --ablate: the table's one-row launch again with
round 20's half-line loads (w4a16.LINES off), and with parts of its work left out (no scale and
offset loads, no weight loads, no products): what each part costs.
python3 -m mpinfer.tools.diag.access_pattern [--int4 [--configs "fma n32 ... split{} ..."]
    [--ablate]]"""

import sys

import torch

from mpinfer.model.kernels.w4a16 import w4a16_matmul
from mpinfer.model.kernels.w8a16 import w8a16_matmul

from .common import graph_us, read_chunks, read_tiles

SHAPES = [("7b1 qkv", 12288, 4096), ("7b1 dense", 4096, 4096), ("7b1 fc1", 16384, 4096),
          ("7b1 fc2", 4096, 16384), ("176b/8 qkv", 5376, 14336), ("176b/8 dense", 14336, 1792),
          ("176b/8 fc1", 7168, 14336), ("176b/8 fc2", 14336, 7168)]  # fmt: skip
INT4 = "--int4" in sys.argv[1:]
CONFIGS = sys.argv[sys.argv.index("--configs") + 1].split(";") if "--configs" in sys.argv else []
ABLATE = "--ablate" in sys.argv[1:]
assert INT4 or not (CONFIGS or ABLATE), "--configs, --ablate: one-row int4 launches, with --int4"
# (label, w4a16_matmul's keywords): half-line loads, then parts of the work left out
VARIANTS = [("half lines (MPINFER_INT4_LINES=0)", dict(lines=False)),
            ("no scale/offset loads", dict(ablate=1)),
            ("no weight loads", dict(ablate=4)),
            ("the loads alone, no products", dict(ablate=8)),
            ("half lines, the loads alone", dict(lines=False, ablate=8))]  # fmt: skip
if INT4:  # (name, N, K): K inputs, K / 2 bytes a row
    SHAPES = [("7b1 qkv", 12288, 4096), ("7b1 fc2", 4096, 16384), ("176b qkv", 43008, 14336),
              ("176b dense", 14336, 14336), ("176b fc1", 57344, 14336),
              ("176b fc2", 14336, 57344)]  # fmt: skip
TILINGS = ([(64, 64, 2), (64, 128, 2), (64, 128, 4), (64, 256, 4), (128, 128, 4), (32, 256, 4)]
           if INT4 else [(16, 256, 4), (64, 128, 4), (64, 256, 4), (32, 256, 4)])  # fmt: skip
if ABLATE or CONFIGS:  # round 17's best tiling of every int4 shape: time for the launches
    TILINGS = [(32, 256, 4)]
sms = torch.cuda.get_device_properties(0).multi_processor_count
pool = torch.randint(-127, 128, (2 << 30,), dtype=torch.int8, device="cuda")
out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
KIND = "W4A16" if INT4 else "W8A16"
print(f"| shape | MB | contiguous us | tiles us | tiling | {KIND} us | {KIND} - contiguous |")
print("|---|---|---|---|---|---|---|")
for name, N, K_in in SHAPES:
    K = K_in // 2 if INT4 else K_in  # bytes a row
    size = N * K
    copies = max(2, min(3 * (60 << 20) // size + 1, (2 << 30) // size))
    views = [pool[i * size : (i + 1) * size] for i in range(copies)]
    reps = max(1, 24 // copies)
    best_c = float("inf")
    for per_sm, block, unroll, warps in [(8, 2048, 2, 4), (4, 4096, 2, 8), (4, 2048, 4, 4)]:
        P = sms * per_sm
        chunk = size // P // (block * unroll) * (block * unroll)
        calls = [lambda v=v, P=P, c=chunk, b=block, u=unroll, w=warps:
                 read_chunks[(P,)](v, out, c, BLOCK=b, UNROLL=u, num_warps=w)
                 for v in views]  # fmt: skip
        best_c = min(best_c, graph_us(calls * reps) * size / (chunk * P))
    best_t = (float("inf"), "")
    for bn, bk, warps in TILINGS:
        for split in (1, 2, 3, 4, 6, 8):
            programs = (N // bn) * split
            if programs < sms or K // bk < split:
                continue
            calls = [lambda v=v, s=split, bn=bn, bk=bk, w=warps, N=N, K=K:
                     read_tiles[(N // bn, s)](v, out, K, s, BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                     for v in views]  # fmt: skip
            best_t = min(best_t, (graph_us(calls * reps), f"n{bn} k{bk} split{split}"))
    scale = torch.rand(N, device="cuda") / 100
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    x = torch.randn(1, K_in, device="cuda", dtype=torch.float16)
    s4 = torch.rand(K_in // 128, N, device="cuda", dtype=torch.float16) / 100  # int4's groups
    z4 = -8 * s4

    def matmul_us(config=None, **kw):  # the launch over every weight copy, in one graph
        if INT4:
            calls = [lambda v=v: w4a16_matmul(x, v.view(torch.uint8).view(N, K), s4, z4, bias,
                                              config=config, **kw) for v in views]  # fmt: skip
        else:
            calls = [lambda v=v: w8a16_matmul(x, v.view(N, K), scale, bias) for v in views]
        return graph_us(calls * reps)

    mm = matmul_us()
    print(f"| {name} | {size / 1e6:.0f} | {best_c:.1f} | {best_t[0]:.1f} | {best_t[1]} | "
          f"{mm:.1f} | {mm - best_c:.1f} |", flush=True)  # fmt: skip
    for label, kw in VARIANTS if ABLATE else []:
        try:
            us = matmul_us(**kw)
            print(f"    {name}: {label}: {us:.1f} us ({us / mm:.2f} x the table's; "
                  f"{size / us / 1e6:.2f} TB/s)", flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported
            print(f"    {name}: {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    for template in CONFIGS:  # the same launch with other configs: the best split of each
        found = []
        for split in (2, 3, 4, 6):
            cfg = template.format(split)
            try:
                found.append((matmul_us(cfg), cfg))
            except Exception as e:  # noqa: BLE001 - an illegal or failing config is reported
                print(f"    {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        if found:
            us, cfg = min(found)
            print(f"    {name}: {cfg}: {us:.1f} us ({size / us / 1e6:.2f} TB/s; table's "
                  f"{mm:.1f}, {size / mm / 1e6:.2f} TB/s; contiguous {size / best_c / 1e6:.2f})",
                  flush=True)  # fmt: skip
