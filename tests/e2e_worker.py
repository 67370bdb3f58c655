"""Runs under torchrun for the end-to-end tests: load several (checkpoint, config) scenarios on
one set of process groups and, for each, write rank 0's prefill logits and greedy generations.

    torchrun --standalone --nproc-per-node N tests/e2e_worker.py SPEC.json OUT_DIR

SPEC: {"ids": [[...]], "mask": [[...]], "prompts": [[...]], "max_new_tokens": n,
       "scenarios": [{"name": ..., "overrides": ["model.path=...", ...]}]}
"""

import json
import sys

import torch

from mpinfer.config import load_config
from mpinfer.dist import init_distributed, teardown
from mpinfer.generation import SamplingParams, generate
from mpinfer.loader import load_model
from mpinfer.model import KVCache


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(open(spec_path).read())
    ctx = init_distributed(timeout_s=120)
    try:
        ids = torch.tensor(spec["ids"])
        mask = torch.tensor(spec["mask"])
        for sc in spec["scenarios"]:
            cfg = load_config(None, sc["overrides"])
            loaded = load_model(cfg, ctx)
            B, T = ids.shape
            cache = KVCache.allocate(
                loaded.shape,
                loaded.tp.tp_size,
                slots=B,
                max_seq=T,
                dtype=loaded.dtype,
                device=ctx.device,
            )
            logits = loaded.model(
                ids,
                cache,
                slots=torch.arange(B),
                start_pos=torch.zeros(B, dtype=torch.long),
                valid_from=(1 - mask).sum(1),
                kv_len=T,
                last_only=False,
            )
            params = SamplingParams(max_new_tokens=spec["max_new_tokens"])
            prompts = spec["prompts"]
            done = generate(loaded, ctx, prompts, [params] * len(prompts))
            if ctx.is_rank0:
                torch.save(
                    {
                        "logits": logits.float(),
                        "tokens": [c.token_ids for c in done],
                        "finish": [c.finish_reason for c in done],
                    },
                    f"{out_dir}/{sc['name']}.pt",
                )
    finally:
        teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
