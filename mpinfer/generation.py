"""Batch generation on all ranks: sampling parameters, logits processors, the decode loop.

Rank 0 owns the prompts and the sampling; every rank runs the same forwards. A batch of prompts
of different lengths is left-padded into one prefill, then decoded together until every row has
stopped (EOS or its max_new_tokens). Each row samples from its own seeded generator, so a seeded
row gives the same tokens whatever else is in the batch. What is not here: continuous batching
and streaming (the engine builds on the same pieces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .dist import DistContext, broadcast_object
from .loader import LoadedModel
from .model import KVCache


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    def check(self) -> SamplingParams:
        """A ValueError naming the first bad field (the server maps it to 422 / 400)."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0")
        for key in ("top_p", "typical_p"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"{key}={value!r} must be in (0, 1]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be > 0")
        if len(self.stop) > MAX_STOP or any(not s for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings, got {list(self.stop)!r}")
        return self


MAX_STOP = 8


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


def process_logits(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None
) -> torch.Tensor:
    """One row's logits (V,) float32 -> the processed logits sampling draws from.

    Order as in transformers: repetition penalty, temperature, top-k, top-p, typical-p. Removed
    tokens get -inf. `seen`: the token ids (prompt and generated) the repetition penalty sees.
    """
    if params.repetition_penalty != 1.0 and seen is not None and seen.numel():
        picked = logits[seen]
        picked = torch.where(
            picked < 0, picked * params.repetition_penalty, picked / params.repetition_penalty
        )
        logits = logits.scatter(0, seen, picked)
    if not params.do_sample:
        return logits
    if params.temperature not in (0.0, 1.0):
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.typical_p < 1.0:
        # Keep the tokens whose surprise is closest to the entropy, up to typical_p of the mass.
        logp = logits.log_softmax(-1)
        p = logp.exp()
        entropy = -(logp * p).nansum()
        distance = (-logp - entropy).abs()
        order = torch.argsort(distance)
        cum = p[order].cumsum(-1)
        keep_n = int((cum < params.typical_p).sum().clamp(max=logits.numel() - 1)) + 1
        drop = torch.ones_like(logits, dtype=torch.bool)
        drop[order[:keep_n]] = False
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def choose_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    if not params.do_sample or params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


class RowSampler:
    """One request's sampling state on rank 0: its parameters, its generator, its history."""

    def __init__(self, prompt: list[int], params: SamplingParams, device: torch.device):
        self.params = params
        self.seen = torch.tensor(prompt, dtype=torch.long, device=device)
        self.gen = None
        if params.do_sample:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(params.seed)

    def next_token(self, logits: torch.Tensor) -> tuple[int, float]:
        """The next token and its log-probability under the distribution it was drawn from."""
        logits = process_logits(logits.float(), self.params, self.seen)
        token = choose_token(logits, self.params, self.gen)
        self.seen = torch.cat([self.seen, self.seen.new_tensor([token])])
        logprob = float(logits.log_softmax(-1)[token]) if self.params.logprobs else 0.0
        return token, logprob


def generate(
    loaded: LoadedModel,
    ctx: DistContext,
    prompts: list[list[int]] | None,
    params: list[SamplingParams] | None,
) -> list[Completion] | None:
    """Run on every rank; rank 0 passes the prompts and gets the completions (others: None)."""
    prompts, params = broadcast_object((prompts, params), ctx)
    model, shape, device = loaded.model, loaded.shape, loaded.device
    B = len(prompts)
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("a prompt has no tokens")
    max_seq = longest + max(p.max_new_tokens for p in params)
    cache = KVCache.allocate(
        shape, loaded.tp.tp_size, slots=B, max_seq=max_seq, dtype=loaded.dtype, device=device
    )
    ids = torch.full((B, longest), shape.pad_token_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :] = torch.tensor(p)  # left padding
    valid_from = torch.tensor([longest - len(p) for p in prompts], device=device)
    slots = slice(0, B)  # a static batch: contiguous slots, read through views
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    out = [Completion(list(p)) for p in prompts]
    samplers = [RowSampler(p, sp, device) for p, sp in zip(prompts, params)] if ctx.is_rank0 else []

    logits = model(
        ids.to(device),
        cache,
        slots=slots,
        start_pos=zeros,
        valid_from=valid_from,
        kv_len=longest,
    )
    pos = longest
    while True:
        # (B + 1,): the next token of each row, then 1 while any row is still going.
        step = torch.zeros(B + 1, dtype=torch.long, device=device)
        if ctx.is_rank0:
            for b in range(B):
                if out[b].finish_reason:
                    step[b] = shape.pad_token_id
                    continue
                token, _ = samplers[b].next_token(logits[b])
                out[b].token_ids.append(token)
                step[b] = token
                if token == shape.eos_token_id:
                    out[b].finish_reason = "eos"
                elif len(out[b].token_ids) >= params[b].max_new_tokens:
                    out[b].finish_reason = "length"
            step[B] = int(not all(c.finish_reason for c in out))
        if ctx.world_size > 1:
            dist.broadcast(step, src=0, group=ctx.compute_group)
        if not int(step[B]):
            break
        logits = model(
            step[:B, None],
            cache,
            slots=slots,
            start_pos=zeros + pos,
            valid_from=valid_from,
            kv_len=pos + 1,
        )
        pos += 1
    return out if ctx.is_rank0 else None
