"""`mpinfer bench WHAT`: every benchmark prints a markdown table and writes JSON (and the table)
under bench/results/, side by side with its baselines in one run.

    gpu       decode and prefill on one GPU against transformers and bitsandbytes (gpubench.py)
    kernels   the W8A16 matmul and the decode attention alone (kernelbench.py)
    load      shard and start times and host RAM, CPU (loadbench.py)
    engine    the engine's tokens/s against concurrency, CPU (servebench.py)
    serve     the real server through HTTP: CPU (servebench.py), or `--gpu` for the served speed
              (servegpu.py)
    kv        the KV cache's layouts (static, blocks, prefix cache, int8) served under one
              budget (kvbench.py)
    budget    the server's GPU memory against its budget (24/12 GiB, offload at 6 GiB, int4)
              under sustained traffic, with prefix-cache hit rates (budgetbench.py)
"""

from __future__ import annotations

import importlib
import sys

WHAT = {
    "gpu": "mpinfer.tools.gpubench",
    "kernels": "mpinfer.tools.kernelbench",
    "load": "mpinfer.tools.loadbench",
    "engine": "mpinfer.tools.servebench",
    "serve": "mpinfer.tools.servebench",
    "kv": "mpinfer.tools.kvbench",
    "budget": "mpinfer.tools.budgetbench",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in WHAT:
        print(__doc__, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(WHAT[argv[0]])
    return module.main(argv if module.__name__.endswith("servebench") else argv[1:])
