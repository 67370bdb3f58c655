"""The memory planner against a GPU (`mpinfer bench gpu --memory`): the planner's per-GPU total
for a shipped config beside what the GPU holds at the peak of serving it with the engine's own
runner and sampler: the weights, the KV cache of the config's slots x max_seq_len, the captured
decode graphs, a prefill of max_prefill_tokens and a sampled decode step over every slot.
"""

from __future__ import annotations

import torch

from ..config import load_config
from ..engine.sampling import Row, Sampler, SamplingParams
from ..engine.step import Prefill, Step
from ..model.memory import GIB, budget_bytes, plan_memory
from .randmodel import SHAPES, build_random, decode_step, free_gpu, make_runner
from .report import md_table

# label, bench shape, row kind (randmodel.build_random), config file, tp size
MEMORY_CASES = [
    ("bloom-7b1 int8", "bloom-7b1", "int8", "configs/bloom-7b1.toml", 1),
    ("bloom-7b1 fp16", "bloom-7b1", "none", "configs/bloom-7b1.toml", 1),
    ("bloom-176b tp-8 rank", "bloom-176b", "int8:emb8", "configs/bloom-176b-8x24gb.toml", 8),
]


def memory_check(label, shape_name, kind, config_path, tp_size) -> dict:
    """Measured = the allocator's peak reservation + what lives outside it (CUDA context,
    cuBLAS and Triton modules), read from the driver."""
    method, _, emb = kind.partition(":")
    cfg = load_config(config_path, [f'quant.method="{method}"',
                                    f'quant.embeddings="{"int8" if emb else "none"}"'])  # fmt: skip
    dev = torch.device("cuda")
    free_gpu()
    plan = plan_memory(SHAPES[shape_name], cfg, tp_size=tp_size, budget=budget_bytes(cfg, dev))
    s = cfg.server
    slots = max(1, min(s.max_batch_slots, plan.slots))
    model, shape, tp = build_random(shape_name, kind, tp_size=tp_size)
    free_gpu()  # the random fill's temporaries are not serving memory (the loader has none)
    runner = make_runner(model, shape, tp, slots=slots, max_seq=s.max_seq_len,
                         cuda_graphs=s.cuda_graphs)  # fmt: skip
    sampler = Sampler(slots=slots, vocab_size=shape.vocab_size, eos_token_id=2, device=dev)
    T = min(s.max_prefill_tokens, s.max_seq_len - 1)
    tokens = tuple(torch.randint(4, shape.vocab_size, (T,)).tolist())
    logits = runner.execute(Step(prefills=(Prefill(0, 0, tokens, sample=True),)))
    sampled = SamplingParams(do_sample=True, top_p=0.9, repetition_penalty=1.1, seed=1)
    sampler.sample(logits, [Row(0, sampled, 0)])
    logits = runner.execute(decode_step(slots, T))
    sampler.sample(logits, [Row(i, sampled, 1) for i in range(slots)])
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    measured = torch.cuda.max_memory_reserved() + outside
    predicted = plan.fixed + slots * s.max_seq_len * plan.kv_bytes_per_token
    peak_allocated = torch.cuda.max_memory_allocated()
    del model, runner, sampler, logits
    free_gpu()
    return {
        "case": label, "config": config_path, "quant": kind, "tp_size": tp_size,
        "slots": slots, "max_seq_len": s.max_seq_len, "prefill_tokens": T,
        "planned": {k: v / GIB for k, v in plan.items.items()},
        "predicted_GiB": predicted / GIB, "measured_GiB": measured / GIB,
        "peak_allocated_GiB": peak_allocated / GIB, "outside_allocator_GiB": outside / GIB,
        "error_pct": 100 * (predicted - measured) / measured,
    }  # fmt: skip


def memory_check_table(checks: list[dict]) -> str:
    header = ["planner vs GPU", "slots x max_seq_len", "prefill", "predicted GiB", "measured GiB",
              "error", "of which outside torch's allocator"]  # fmt: skip
    checks = [m for m in checks if "error" not in m]
    return md_table(header, [
        [m["case"], f"{m['slots']} x {m['max_seq_len']}", m["prefill_tokens"],
         f"{m['predicted_GiB']:.2f}", f"{m['measured_GiB']:.2f}", f"{m['error_pct']:+.1f} %",
         f"{m['outside_allocator_GiB']:.2f} GiB"]
        for m in checks
    ])  # fmt: skip
