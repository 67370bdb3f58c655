"""What one launch costs on this GPU, apart from its bytes: the per-launch floor the decode
step's ~280 matmul launches pay. In CUDA graphs (as the step runs), each size cycling through
enough buffers to miss the L2:
- an empty kernel, back to back: the launch itself;
- a read-only kernel (int8 bytes summed, as many loads in flight as it can) at 8 MB to 1 GB,
  fitted to time = fixed + bytes / rate between sizes: the hardware's ramp and tail;
- the W8A16 matmul at one row at the same sizes (N x 4096), the better of two configs that
  the tuned table picks for large and mid-size launches.
Writes a markdown table to stdout.  python3 -m mpinfer.tools.diag.launch_floor"""

import torch
import triton

from .common import graph_us, read_chunks


@triton.jit
def _empty(x_ptr):
    """Nothing on purpose: what is timed is the launch alone."""


MATMUL_CONFIGS = ["dot n64 k256 split1 pf0 magic2 w4 s3", "fma n16 k256 split1 pf0 magic2 w4 s3"]


def fit(points):
    """(fixed us, rate GB/s) of time = fixed + bytes / rate, least squares over (bytes, us)."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, 1 / slope / 1e3


sms = torch.cuda.get_device_properties(0).multi_processor_count
pool = torch.randint(-127, 128, (2 << 30,), dtype=torch.int8, device="cuda")  # 2 GiB
out = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
empty = graph_us([lambda: _empty[(sms * 4,)](out)] * 200)
print(f"{torch.cuda.get_device_name()}, {sms} SMs\n")
print(f"empty kernel ({sms * 4} programs), back to back in a graph: {empty:.2f} us a launch\n")
sizes = [8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20, 256 << 20, 512 << 20, 1 << 30]
print(
    "| bytes MB | read-only us | GB/s | config | W8A16 1 row us | GB/s |\n|---|---|---|---|---|---|"
)
reads, mms = [], []
from mpinfer.model.kernels.w8a16 import w8a16_matmul  # noqa: E402

for size in sizes:
    copies = max(2, min(2 * (2 << 30) // (3 * size), (2 << 30) // size))
    best = (float("inf"), "")
    for per_sm, block, unroll, warps in [(4, 2048, 4, 4), (8, 2048, 2, 4), (2, 4096, 4, 8),
                                         (4, 4096, 2, 8), (1, 8192, 4, 16)]:  # fmt: skip
        P = sms * per_sm
        chunk = size // P // (block * unroll) * (block * unroll)
        calls = [lambda v=pool[i * size :], P=P, chunk=chunk, b=block, u=unroll, w=warps:
                 read_chunks[(P,)](v, out, chunk, BLOCK=b, UNROLL=u, num_warps=w)
                 for i in range(copies)] * max(1, 24 // copies)  # fmt: skip
        us = graph_us(calls) * size / (chunk * P)  # scaled to `size` bytes (chunks round down)
        best = min(best, (us, f"{per_sm}/SM x {block}x{unroll} w{warps}"))
    reads.append((size, best[0]))
    N = size // 4096
    qs = [pool[i * N * 4096 : (i + 1) * N * 4096].view(N, 4096) for i in range(copies)]
    scale = torch.rand(N, device="cuda") / 100
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    mm = float("inf")
    for cfg in MATMUL_CONFIGS:
        calls = [lambda q=q, x=x, s=scale, c=cfg: w8a16_matmul(x, q, s, None, config=c) for q in qs]
        mm = min(mm, graph_us(calls * max(1, 24 // copies)))
    mms.append((size, mm))
    print(f"| {size >> 20} | {best[0]:.1f} | {size / best[0] / 1e3:.0f} | {best[1]} | {mm:.1f} | "
          f"{size / mm / 1e3:.0f} |", flush=True)  # fmt: skip
for name, pts in [("read-only", reads), ("W8A16", mms)]:
    f0, r0 = fit(pts[:4])
    f1, r1 = fit(pts[3:])
    print(
        f"\n{name}: 8-64 MB fit {f0:.1f} us + bytes / {r0:.0f} GB/s; "
        f"64 MB-1 GB fit {f1:.1f} us + bytes / {r1:.0f} GB/s",
        end="",
    )
print()
