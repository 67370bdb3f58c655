"""`mpinfer bench load` (CPU): random checkpoints of about 0.5, 1 and 2 GB (fp16): the shard
command (time, peak RAM), start from the HF checkpoint (rank-0 path) and from the sharded
directory, at tp 2 and 4, every rank's anonymous host RSS (start, peak, final), beside
transformers' from_pretrained(low_cpu_mem_usage=True) of the same checkpoint. Prints a markdown
table and writes JSON (and the table) under bench/results/.

Each measured process reports in JSON (`python -m mpinfer.tools.loadbench worker|shard|hf`),
so nothing here reads log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..checkpoint.hostmem import HostMemoryMonitor, return_large_frees_to_os
from ..checkpoint.loader import load_model
from ..checkpoint.sharded import shard_checkpoint
from ..config import load_config
from ..dist import init_distributed, teardown, torchrun_command
from ..extras import require
from ..model.bloom import BloomShape
from ..model.sharding import shard_specs
from .report import machine, md_table, save_result
from .tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], timeout: float = 900) -> tuple[dict, float]:
    """Run a measuring process; (the JSON it printed last, wall seconds)."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def _load(model: str, tp: int) -> dict:
    out = Path(model).parent / f"load-report-{os.getpid()}.json"
    _, wall = _run(torchrun_command(tp, ["-m", "mpinfer.tools.loadbench", "worker", model,
                                         str(out)]))  # fmt: skip
    report = json.loads(out.read_text())
    out.unlink()
    return {**report, "process_s": wall}


def worker(model: str, out: str) -> None:
    """Under torchrun: load `model` on every rank; rank 0 writes the load time and every rank's
    host RAM (start, peak, final MiB)."""
    cfg = load_config(None, [f'model.path="{model}"'])
    ctx = init_distributed()
    try:
        loaded = load_model(cfg, ctx)
        if ctx.is_rank0:
            ranks = [{"peak": peak, "over_start": peak - start, "final": end}
                     for start, peak, end in loaded.host_rss_mib]  # fmt: skip
            Path(out).write_text(json.dumps({"load_s": loaded.load_seconds, "ranks": ranks}))
            print("{}")
    finally:
        teardown()


def shard_worker(src: str, out: str, tp: int) -> None:
    return_large_frees_to_os()
    with HostMemoryMonitor() as mem:
        shard_checkpoint(src, out, tp_size=tp, progress=False)
    print(json.dumps({"peak": mem.peak_mib, "over_start": mem.peak_mib - mem.start_mib}))


def hf_worker(model: str) -> None:
    transformers = require("transformers")
    with HostMemoryMonitor() as m:
        t = time.perf_counter()
        transformers.BloomForCausalLM.from_pretrained(model, dtype=torch.float16,
                                                      low_cpu_mem_usage=True)  # fmt: skip
        t = time.perf_counter() - t
    print(json.dumps({"load_s": t, "peak": m.peak_mib, "start": m.start_mib, "final": m.end_mib}))


def largest_slice_mib(model: str, tp: int, dtype_bytes: int = 4) -> float:
    """The largest tensor slice a rank holds, in the compute dtype (fp32 on CPU)."""
    shape = BloomShape.from_config(json.loads((Path(model) / "config.json").read_text()))
    biggest = 0
    for spec in shard_specs(shape, tp, weights="int8"):
        n = torch.Size(spec.rank_shape(tp)).numel()
        biggest = max(biggest, n * (1 if spec.quantize else dtype_bytes))
    return biggest / 2**20


def run_load(a) -> dict:
    work = Path(a.workdir)
    rows = []
    for gb in a.sizes:
        layers = max(1, round(gb * 1e9 / (12 * 1024 * 1024 * 2)))  # 12 h^2 fp16 per layer
        src = work / f"hf-{gb}gb"
        if not (src / "config.json").exists():
            make_tiny(src, layers=layers, hidden=1024, heads=16, vocab=16384, shards=4,
                      dtype="float16", tokenizer_vocab=4096)  # fmt: skip
        size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
        hf, _ = _run([sys.executable, "-m", "mpinfer.tools.loadbench", "hf", str(src)])
        for tp in a.tps:
            out = work / f"sharded-{gb}gb-tp{tp}"
            shard, shard_s = _run([sys.executable, "-m", "mpinfer.tools.loadbench", "shard",
                                   str(src), str(out), str(tp)])  # fmt: skip
            row = {
                "checkpoint_GB": size,
                "layers": layers,
                "tp": tp,
                "largest_slice_MiB": largest_slice_mib(str(src), tp),
                "shard_s": shard_s,
                "shard_peak_MiB": round(shard["peak"]),
                "shard_over_start_MiB": round(shard["over_start"]),
                "rank0_path": _load(str(src), tp),
                "sharded_path": _load(str(out), tp),
                "transformers": hf,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows}


def load_table(result: dict) -> str:
    def over(ranks):  # the largest peak-over-final of these ranks' host RAM
        return round(max(k["peak"] - k["final"] for k in ranks)) if ranks else 0

    header = ["ckpt GB", "tp", "largest slice MiB", "shard s", "shard peak MiB", "start HF s",
              "start sharded s", "rank 0 peak-final MiB (HF / sharded)",
              "other ranks peak-final MiB (HF / sharded)", "target r0 / others MiB",
              "transformers peak MiB, s"]  # fmt: skip
    rows = []
    for r in result["rows"]:
        h, s, sl = r["rank0_path"], r["sharded_path"], r["largest_slice_MiB"]
        rows.append([
            f"{r['checkpoint_GB']:.2f}", r["tp"], f"{sl:.0f}", f"{r['shard_s']:.1f}",
            r["shard_peak_MiB"], f"{h['process_s']:.1f}", f"{s['process_s']:.1f}",
            f"{over(h['ranks'][:1])} / {over(s['ranks'][:1])}",
            f"{over(h['ranks'][1:])} / {over(s['ranks'][1:])}",
            f"{3 * sl + 256:.0f} / {2 * sl + 256:.0f}",
            f"{r['transformers']['peak']:.0f}, {r['transformers']['load_s']:.1f}",
        ])  # fmt: skip
    return md_table(header, rows)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer bench load", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/mpinfer-bench")
    p.add_argument("--out", default="bench/results/load-cpu.json")
    p.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1, 2])
    p.add_argument("--tps", type=int, nargs="+", default=[2, 4])
    a = p.parse_args(argv)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    result = run_load(a)
    result["machine"] = {**machine(), "cpus": os.cpu_count()}
    save_result(result, a.out, load_table(result))
    return 0


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "worker":
        worker(*args)
    elif what == "shard":
        shard_worker(args[0], args[1], int(args[2]))
    elif what == "hf":
        hf_worker(args[0])
