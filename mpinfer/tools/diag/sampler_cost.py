"""What the sampler's pass costs the GPU per step, by row count and kind of row (GPU only):

    python -m mpinfer.tools.diag.sampler_cost [--vocab 250880] [--out FILE]

For 1-64 rows of BLOOM's vocabulary: the GPU time (CUDA events, median of 20 after a warm-up)
and the host's time to issue it, of `Sampler.sample` over greedy rows, rows at temperature 1
(what the OpenAI routes do when a request names no temperature) and rows with top-p 0.9; and of
the draw alone, the two-level search the sampler uses beside one float64 scan of the whole row
(the sampler's draw until round 10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ...engine.draw import draw
from ...engine.sampling import Row, Sampler, SamplingParams
from ..report import md_table

KINDS = {
    "greedy": SamplingParams(max_new_tokens=8),
    "temperature 1": SamplingParams(max_new_tokens=8, do_sample=True, seed=1),
    "top-p 0.9": SamplingParams(max_new_tokens=8, do_sample=True, seed=1, top_p=0.9),
}


def one_scan_draw(processed: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse CDF over one float64 scan of each whole row."""
    cdf = processed.softmax(-1).double().cumsum(-1)
    at = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, at, right=True)[:, 0].clamp(max=processed.shape[1] - 1)


def timed(fn, iters: int = 20) -> tuple[float, float]:
    """(GPU ms, host ms) medians of fn()."""
    for _ in range(3):
        fn()
    gpu, host = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=250_880)
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    V, dev = a.vocab, torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "vocab": V, "cases": []}
    table = []
    for n in [int(v) for v in a.rows.split(",")]:
        logits = torch.randn(n, V, device=dev, dtype=torch.float16) * 3
        u = torch.rand(n, device=dev, dtype=torch.float64)
        x = logits.float()
        case = {"rows": n}
        case["draw_ms"], _ = timed(lambda: draw(x, u))
        case["one_scan_draw_ms"], _ = timed(lambda: one_scan_draw(x, u))
        same = torch.equal(draw(x, u), one_scan_draw(x, u))
        case["draws_equal"] = same
        for kind, params in KINDS.items():
            sampler = Sampler(slots=n, vocab_size=V, eos_token_id=2, device=dev)
            rows = [Row(i, params, 0) for i in range(n)]
            case[kind] = timed(lambda s=sampler, r=rows: s.sample(logits, r))
        result["cases"].append(case)
        cells = [f"{case[k][0]:.3f} / {case[k][1]:.2f}" for k in KINDS]
        table.append([n, *cells, f"{case['draw_ms']:.3f}", f"{case['one_scan_draw_ms']:.3f}", same])
    print(f"{result['gpu']}, vocabulary {V}: GPU ms / host ms per pass")
    print(md_table(["rows", *KINDS, "draw ms", "one-scan draw ms", "same tokens"], table))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
