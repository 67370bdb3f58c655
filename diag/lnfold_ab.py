import torch, sys
from mpinfer.kernels.w8a16 import w8a16_matmul
from mpinfer.quant import quantize_rows, fold_ln
torch.manual_seed(0)
for N, K in [(12288, 4096), (16384, 4096)]:
    qs = [quantize_rows(torch.randn(N, K, device="cuda")) for _ in range(6)]
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    ln = torch.nn.LayerNorm(K, device="cuda", dtype=torch.float16)
    folds = [fold_ln(q, s, bias, ln) for q, s in qs]
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    res = {}
    for name in ("plain", "folded"):
        def run():
            for (q, s), f in zip(qs, folds):
                if name == "plain":
                    w8a16_matmul(x, q, s, bias)
                else:
                    w8a16_matmul(x, q, s, None, ln=f)
        run(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10): run()
        g.replay(); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(5):
            e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3 / 60)
        res[name] = min(ts)
    print(f"{N}x{K}: plain {res['plain']:.1f} us, folded {res['folded']:.1f} us", flush=True)
import os, json
from mpinfer.kernels import w8a16
out = "/tmp/dump"; os.makedirs(out, exist_ok=True)
n = 0
for dev, caches in w8a16._w8a16.fn.device_caches.items():
    kernel_cache = caches[0]
    for key, k in kernel_cache.items():
        n += 1
        tag = f"k{n}"
        with open(f"{out}/{tag}.ptx", "w") as f:
            f.write(f"// {key}\n")
            f.write(k.asm["ptx"])
        with open(f"{out}/{tag}.ttgir", "w") as f:
            f.write(k.asm["ttgir"])
        print(tag, str(key)[:300])
import subprocess
subprocess.run(["tar", "czf", os.environ.get("OUT", "/tmp") + "/dump.tgz", "-C", "/tmp", "dump"])
