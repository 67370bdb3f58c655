"""Random BLOOMs made on the GPU for the benchmarks (no checkpoint), and the engine's own runner
around them, so a benchmark times the decode step the server runs.

`SHAPES` are the published architectures in configs/arch/ (and a tiny one for CPU smoke runs).
`build_random(shape, kind)` builds the model mpinfer would load for that quant method, filled
with random int8 rows and scales; `make_runner` wraps it in a `ModelRunner` (the KV cache and the
captured decode graphs of the engine) and `decode_step` is one engine decode step over the
first B slots.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import torch

from ..checkpoint.loader import build_meta_model, finish_model
from ..config import load_config
from ..dist import DistContext
from ..engine.runner import ModelRunner
from ..engine.step import Prefill, Step
from ..model.bloom import BloomShape, LoadedModel
from ..model.layers import TPGroup

ARCH_DIR = Path(__file__).resolve().parents[2] / "configs" / "arch"


def load_shapes() -> dict[str, BloomShape]:
    return {p.stem: BloomShape.from_config(json.loads(p.read_text()))
            for p in sorted(ARCH_DIR.glob("*.json"))}  # fmt: skip


SHAPES = load_shapes()


def randomize_model(model, *, seed: int = 0, finish: bool = True) -> None:
    """Fill a model (storage uninitialized, on its device or in host memory) with random
    weights: int8 rows (or int4 groups) with scales giving std ~1/sqrt(fan_in), unit
    LayerNorms. The values are
    drawn on the GPU when there is one, so a weight gets the same values wherever it lives.
    `finish`: also run the after-load hooks."""
    gen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=gen).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype in (torch.int8, torch.uint8):  # int8 rows, or two int4 values a byte
                lo, hi = (-127, 128) if p.dtype == torch.int8 else (0, 256)
                p.copy_(torch.randint(lo, hi, p.shape, generator=g, device=gen, dtype=p.dtype))
            elif name.endswith("weight_scale") and p.dim() == 2:  # int4: q uniform in 0..15
                fan_in = 2 * model.get_parameter(name[: -len("_scale")]).shape[1]
                p.fill_(1 / 4.61 / math.sqrt(fan_in))  # 4.61: the std of q
            elif name.endswith("weight_offset"):
                p.copy_(model.get_parameter(name[: -len("_offset")] + "_scale") * -7.5)
            elif name.endswith("weight_scale"):
                fan_in = model.get_parameter(name[: -len("_scale")]).shape[1]
                p.fill_(1.7 / math.sqrt(fan_in) / 127)
            elif "layernorm.weight" in name or name == "ln_f.weight":
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                w = torch.empty(p.shape, dtype=p.dtype, device=gen)
                p.copy_(w.normal_(0, 1 / math.sqrt(p.shape[1]), generator=g))
    if finish:
        finish_model(model, next(model.parameters()).device)


def build_random(shape_name: str, kind: str, *, tp_size: int = 1, tp_rank: int = 0, group=None,
                 dtype=torch.float16, device: str = "cuda", seed: int = 0):  # fmt: skip
    """kind: a quant method, with ":emb8" for int8 embeddings too (e.g. "int8:emb8") and "@bf16"
    for bf16 activations (e.g. "int8@bf16"). tp_size > 1 without a group: one simulated rank
    (collectives skipped and counted)."""
    kind, _, act = kind.partition("@")
    if act:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[act]
    method, _, emb = kind.partition(":")
    shape = SHAPES[shape_name]
    embeddings = "int8" if emb == "emb8" else "none"
    cfg = load_config(None, [f'quant.method="{method}"', f'quant.embeddings="{embeddings}"'])
    tp = TPGroup(tp_rank, tp_size, group)
    model = build_meta_model(shape, tp, cfg, dtype).to_empty(device=device)
    randomize_model(model, seed=seed)
    return model, shape, tp


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def make_runner(model, shape, tp, *, slots: int, max_seq: int, cuda_graphs: bool = True,
                ctx: DistContext | None = None, max_prefill_tokens: int = 512,
                **cache) -> ModelRunner:  # fmt: skip
    """The engine's runner around a built model (a world of one unless `ctx` says otherwise);
    `cache`: ModelRunner's block_size, num_blocks, kv_int8."""
    device = next(model.parameters()).device
    ctx = ctx or DistContext(0, 1, 0, device, None, None)
    loaded = LoadedModel(model, shape, tp, model.dtype, device, "")
    return ModelRunner(loaded, ctx, slots=slots, max_seq=max_seq, cuda_graphs=cuda_graphs,
                       max_prefill_tokens=max_prefill_tokens, **cache)  # fmt: skip


def fill_context(runner: ModelRunner, slots: int, context: int, *, seed: int = 0) -> None:
    """Prefill `context` random tokens into each of the first `slots` slots."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.loaded.shape.vocab_size
    for s in range(slots):
        tokens = torch.randint(4, vocab, (context,), generator=g).tolist()
        runner.execute(Step(prefills=(Prefill(s, 0, tuple(tokens)),)))


def decode_step(batch: int, context: int) -> Step:
    """One decode row per slot 0..batch-1, each after `context` cached tokens."""
    return Step(decode_slots=tuple(range(batch)), decode_pos=(context,) * batch)
