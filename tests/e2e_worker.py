"""Runs under torchrun for the end-to-end tests: load several (checkpoint, config) scenarios on
one set of process groups and, for each, write rank 0's prefill logits of a left-padded batch
(the model's forward) and the engine's greedy generations of the prompts, all in one batch.

    torchrun --standalone --nproc-per-node N tests/e2e_worker.py SPEC.json OUT_DIR

SPEC: {"ids": [[...]], "mask": [[...]], "prompts": [[...]], "max_new_tokens": n,
       "scenarios": [{"name": ..., "overrides": ["model.path=...", ...]}]}
"""

import json
import sys

import torch

from mpinfer.config import load_config
from mpinfer.dist import init_distributed, teardown
from mpinfer.engine.sampling import SamplingParams
from mpinfer.model.bloom import KVCache
from mpinfer.startup.runtime import prepare, start


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(open(spec_path).read())
    ctx = init_distributed(timeout_s=120)
    try:
        ids = torch.tensor(spec["ids"])
        mask = torch.tensor(spec["mask"])
        prompts = spec["prompts"]
        for sc in spec["scenarios"]:
            cfg = load_config(None, sc["overrides"])
            max_seq = max(map(len, prompts)) + spec["max_new_tokens"]
            runner = prepare(cfg, ctx, slots=len(prompts), max_seq=max_seq)
            engine = start(cfg, ctx, runner=runner)  # rank 1..: serves the steps, then None
            if engine is not None:
                results = {}
                params = SamplingParams(max_new_tokens=spec["max_new_tokens"])
                for i, p in enumerate(prompts):
                    engine.submit(p, params, lambda ev, i=i: ev.kind != "token"
                                  and results.update({i: ev.result}))  # fmt: skip
                engine.run(until_idle=True)
            loaded = runner.loaded
            B, T = ids.shape
            cache = KVCache.allocate(loaded.shape, loaded.tp.tp_size, slots=B, max_seq=T,
                                     dtype=loaded.dtype, device=ctx.device)  # fmt: skip
            logits = loaded.model(ids, cache, slots=torch.arange(B),
                                  start_pos=torch.zeros(B, dtype=torch.long),
                                  valid_from=(1 - mask).sum(1), kv_len=T, output="all")  # fmt: skip
            if ctx.is_rank0:
                torch.save({"logits": logits.float(),
                            "tokens": [results[i].token_ids for i in range(len(prompts))],
                            "finish": [results[i].finish_reason for i in range(len(prompts))]},
                           f"{out_dir}/{sc['name']}.pt")  # fmt: skip
    finally:
        teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
