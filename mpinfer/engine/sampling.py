"""Sampling: a request's parameters, and one batched pass that turns a step's logits into tokens.

`SamplingParams` is what a request asks for, with the ranges the sampler can compute (checked
before a request is queued). `Sampler` lives on rank 0 beside the engine: each step it takes the
logits of every row to sample (decode rows and prompts that just finished their prefill), applies
each row's processors with per-row parameter tensors, draws, and packs every row's token, its
log-probability and its top alternatives into one tensor, which the engine copies to the host
once. Greedy and sampling rows mix in one batch; nothing here loops over rows on the device.

Processors, in transformers' order: logit bias and allowed tokens, repetition penalty (over the
prompt and the generated tokens), OpenAI's frequency and presence penalties (generated tokens),
temperature, top-k, top-p, min-p, typical-p. A sampling row draws by inverting its distribution's
CDF at one uniform number made from its seed and the token's index in the request (a counter-based
generator, `uniform`), so a seeded request gives the same tokens alone or in any batch.
Log-probabilities are those of the model's own distribution (the raw logits), as vLLM reports
them. What is not here: the draw (draw.py), stop conditions and text (engine.py, detok.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..model.bloom import to_device
from ..model.memory import chunk_rows
from .draw import draw, prefix_sums

# Below this temperature a request is greedy: x / T would leave fp32's range.
MIN_TEMPERATURE = 1e-5
# repetition_penalty outside this range divides logits past fp32's range (or means nothing).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# frequency_penalty and presence_penalty: OpenAI's range.
PENALTY_RANGE = (-2.0, 2.0)
MAX_STOP = 8
MAX_TOP_N = 20  # alternatives per token (OpenAI chat allows 20)
SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: the engine draws one (and reports it)
    stop: tuple[str, ...] = ()
    top_n: int = 0  # alternatives (token, log-probability) per generated token
    # vLLM's logprob_token_ids: these tokens' log-probabilities as the alternatives (top_n of
    # them), in place of the most likely ones
    logprob_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int = -1  # >= 0: every prompt token's log-probability, and this many alts
    ignore_eos: bool = False  # keep generating past EOS (load generators use it)
    min_tokens: int = 0  # EOS cannot end the request before this many tokens
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the logits before anything
    # else (greedy rows too); vLLM's allowed_token_ids: every other token is excluded.
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0  # vLLM's: drop tokens below min_p x the most likely token's probability
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: these tokens end the request (as EOS does)
    skip_special_tokens: bool = True  # the generated text leaves special tokens out
    include_stop_str_in_output: bool = False  # the text ends with the stop string that ended it
    cache_salt: str = ""  # vLLM's: prefix-cache blocks are shared only with the same salt

    @functools.cached_property
    def token_lists(self) -> TokenLists:
        """logit_bias, allowed_token_ids and stop_token_ids as tensors, made once per request
        (not once per step: a request may name thousands of tokens)."""
        ids = [t for t, _ in self.logit_bias]
        return TokenLists(
            bias_ids=torch.tensor(ids, dtype=torch.long),
            bias=torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32),
            allowed=torch.tensor(self.allowed_token_ids, dtype=torch.long),
            stop=torch.tensor(self.stop_token_ids, dtype=torch.long),
        )

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < MIN_TEMPERATURE

    @property
    def uses_history(self) -> bool:
        """Whether a processor reads the tokens seen so far (the sampler's per-slot state)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)  # fmt: skip

    def check(self) -> SamplingParams:
        """A ValueError naming the first bad field (the server maps it to 422 / 400)."""
        for key in ("max_new_tokens", "top_k", "min_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key}={value!r} must be an integer >= 0")
        for key in ("temperature", "top_p", "typical_p", "repetition_penalty",
                    "frequency_penalty", "presence_penalty"):  # fmt: skip
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key}={value!r} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        for key in ("top_p", "typical_p"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"{key}={value!r} must be in (0, 1]")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be in "
                             f"[{lo}, {hi}]")  # fmt: skip
        lo, hi = PENALTY_RANGE
        for key in ("frequency_penalty", "presence_penalty"):
            if not lo <= getattr(self, key) <= hi:
                raise ValueError(f"{key}={getattr(self, key)!r} must be in [{lo}, {hi}]")
        if self.seed is not None and not (
            isinstance(self.seed, int) and 0 <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2^64 - 1]")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings, got {list(self.stop)!r}")
        if not 0 <= self.top_n <= MAX_TOP_N:
            raise ValueError(f"top_n={self.top_n!r} must be in [0, {MAX_TOP_N}]")
        if self.logprob_token_ids and len(self.logprob_token_ids) != self.top_n:
            raise ValueError(f"top_n={self.top_n!r} must be the number of logprob_token_ids "
                             f"({len(self.logprob_token_ids)})")  # fmt: skip
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")
        for token, bias in self.logit_bias:
            if not (isinstance(bias, (int, float)) and math.isfinite(bias)
                    and -100 <= bias <= 100):  # fmt: skip
                raise ValueError(f"logit_bias: the bias of token {token} ({bias!r}) must be in "
                                 "[-100, 100]")  # fmt: skip
        if not -1 <= self.prompt_logprobs <= MAX_TOP_N:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs!r} must be in [0, "
                             f"{MAX_TOP_N}]")  # fmt: skip
        return self


def uniform(seed: int, index: int) -> float:
    """A number in [0, 1) that depends only on (seed, index): SplitMix64 of their mix."""
    mask = 2**64 - 1
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) / 2**53


@dataclass(frozen=True)
class Row:
    """One row of a step to sample: its slot, its request's parameters, the token's index."""

    slot: int
    params: SamplingParams
    index: int  # 0 for the request's first generated token


# Columns of the per-row parameter tensor.
TEMP, TOP_K, TOP_P, TYPICAL, REP, FREQ, PRES, U, GREEDY, BLOCK_EOS, MIN_P = range(11)


@dataclass(frozen=True)
class TokenLists:
    """A request's token lists on the host (SamplingParams.token_lists)."""

    bias_ids: torch.Tensor
    bias: torch.Tensor
    allowed: torch.Tensor
    stop: torch.Tensor


def by_row(pairs: list[tuple[int, torch.Tensor]]):
    """(row index per entry, the entries): rows' lists joined, without a Python loop over the
    entries themselves."""
    rows = torch.cat([torch.full((len(v),), i, dtype=torch.long) for i, v in pairs])
    return rows, torch.cat([v for _, v in pairs])


@dataclass(frozen=True)
class Needs:
    """Which processors a batch needs, decided on the host (reading the device would wait for
    the step in flight)."""

    top_p: tuple[int, ...] = ()  # rows with top-p (sorted: top-k too, if they have it)
    top_k: int = 0  # the largest k of the other rows with top-k (0: none)
    temperature: bool = False  # some row divides by a temperature other than 1
    typical: bool = False
    block_eos: tuple[int, ...] = ()  # rows where EOS may not end the request yet
    history: bool = False  # some row has a penalty: the per-slot history is read
    min_p: bool = False
    # (rows, tokens) host tensors: stop_token_ids that may not be generated yet (min_tokens,
    # as vLLM), allowed_token_ids; (rows, tokens, biases) of logit_bias; None when no row has any
    block_stop: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None


def row_table(rows: list[Row], vocab_size: int) -> tuple[torch.Tensor, Needs]:
    """(n, 11) float64 on the host: each row's parameters, neutral values where unused; and
    what the batch needs."""
    table = []
    for r in rows:
        p = r.params
        greedy = p.greedy
        table.append([
            1.0 if greedy else p.temperature,
            float(p.top_k if 0 < p.top_k < vocab_size and not greedy else vocab_size),
            2.0 if greedy or p.top_p >= 1 else p.top_p,  # 2: more than any cumulative mass
            1.0 if greedy else p.typical_p,
            p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
            0.0 if greedy else uniform(p.seed or 0, r.index),
            float(greedy), float(r.index < p.min_tokens), 0.0 if greedy else p.min_p,
        ])  # fmt: skip
    top_p = tuple(i for i, row in enumerate(table) if row[TOP_P] < 1)
    top_k = [int(row[TOP_K]) for row in table if row[TOP_K] < vocab_size and row[TOP_P] >= 1]
    stop = [(i, r.params.token_lists.stop) for i, r in enumerate(rows)
            if r.index < r.params.min_tokens and r.params.stop_token_ids]  # fmt: skip
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    allowed = [(i, r.params.token_lists.allowed) for i, r in enumerate(rows)
               if r.params.allowed_token_ids]  # fmt: skip
    bias = None
    if biased:
        rows_, ids = by_row([(i, rows[i].params.token_lists.bias_ids) for i in biased])
        bias = (rows_, ids, torch.cat([rows[i].params.token_lists.bias for i in biased]))
    needs = Needs(
        top_p=top_p,
        top_k=max(top_k, default=0),
        temperature=any(row[TEMP] != 1 for row in table),
        typical=any(row[TYPICAL] < 1 for row in table),
        block_eos=tuple(i for i, row in enumerate(table) if row[BLOCK_EOS]),
        block_stop=by_row(stop) if stop else None,
        history=any(r.params.uses_history for r in rows),
        min_p=any(row[MIN_P] > 0 for row in table),
        bias=bias,
        allowed=by_row(allowed) if allowed else None,
    )
    return torch.tensor(table, dtype=torch.float64), needs


def process_logits(
    x: torch.Tensor,
    t: torch.Tensor,
    needs: Needs,
    *,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    eos_token_id: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(penalized, processed) logits of n rows, both (n, V) float32.

    x: the raw logits (n, V) float32; t: `row_table` on x's device. `penalized` has the
    penalties (and EOS and stop_token_ids blocked where min_tokens asks): greedy rows take its
    argmax. `processed` has temperature, top-k, top-p and typical-p on top, removed tokens at
    -inf: sampling rows draw from it. `seen`: (n, V) bool, tokens of the prompt; `counts`:
    (n, V) generated-token counts (both when `needs.history`)."""
    n, V = x.shape
    col = lambda c: t[:, c : c + 1].to(x.dtype)  # noqa: E731  (n, 1)
    if needs.bias is not None:
        rows, toks, values = (v.to(x.device, non_blocking=True) for v in needs.bias)
        x = x.index_put((rows, toks), values.to(x.dtype), accumulate=True)
    if needs.allowed is not None:
        rows, toks = (v.to(x.device, non_blocking=True) for v in needs.allowed)
        keep = torch.ones_like(x, dtype=torch.bool)
        keep[rows] = False
        keep[rows, toks] = True
        x = x.masked_fill(~keep, float("-inf"))
    if needs.history:
        used = seen | (counts > 0)
        rep = col(REP)
        x = torch.where(used, torch.where(x < 0, x * rep, x / rep), x)
        x = x - col(FREQ) * counts - col(PRES) * (counts > 0).to(x.dtype)
    if needs.block_eos and 0 <= eos_token_id < V:
        rows = to_device(needs.block_eos, x.device)
        cols = torch.full_like(rows, eos_token_id)
        x = x.index_put((rows, cols), torch.full_like(cols, -1, dtype=x.dtype) * float("inf"))
    if needs.block_stop is not None:
        rows, toks = (v.to(x.device, non_blocking=True) for v in needs.block_stop)
        x = x.index_put((rows, toks), torch.full_like(rows, -1, dtype=x.dtype) * float("inf"))
    y = x / col(TEMP) if needs.temperature else x
    if needs.top_p:
        # Top-k and top-p over the sorted distribution, then back to vocabulary order; only
        # the rows with top-p are sorted.
        every = len(needs.top_p) == n
        rows = None if every else to_device(needs.top_p, x.device)
        sub, ts = (y, t) if every else (y.index_select(0, rows), t.index_select(0, rows))
        values, order = sub.sort(dim=-1, descending=True)
        kth = values.gather(1, (ts[:, TOP_K : TOP_K + 1].long() - 1).clamp(0, V - 1))
        values = values.masked_fill(values < kth, float("-inf"))
        probs = values.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (prefix_sums(probs) - probs) >= ts[:, TOP_P : TOP_P + 1].to(x.dtype)
        drop[:, 0] = False
        values = values.masked_fill(drop, float("-inf"))
        sub = torch.empty_like(sub).scatter_(1, order, values)
        y = sub if every else y.index_copy(0, rows, sub)
    if needs.top_k:
        top = y.topk(needs.top_k, dim=-1).values  # (n, largest k)
        kth = top.gather(1, (t[:, TOP_K : TOP_K + 1].long() - 1).clamp(0, needs.top_k - 1))
        # rows without top-k, and the sorted ones (done above), keep everything here
        cut = (t[:, TOP_K : TOP_K + 1] < V) & (t[:, TOP_P : TOP_P + 1] >= 1)
        kth = torch.where(cut, kth, float("-inf"))
        y = y.masked_fill(y < kth, float("-inf"))
    if needs.min_p:
        probs = y.softmax(-1)
        y = y.masked_fill(probs < col(MIN_P) * probs.max(-1, keepdim=True).values, float("-inf"))
    if needs.typical:
        # Keep the tokens whose surprise is closest to the entropy, up to typical_p of the mass
        # (transformers' TypicalLogitsWarper, per row).
        logp = y.log_softmax(-1)
        p = logp.exp()
        entropy = -torch.nan_to_num(logp * p).sum(-1, keepdim=True)
        distance = (-logp - entropy).abs()
        d_sorted, order = distance.sort(dim=-1)
        cum = prefix_sums(p.gather(1, order))
        last = (cum < col(TYPICAL)).sum(-1, keepdim=True).clamp(max=V - 1)
        drop = distance > d_sorted.gather(1, last)
        drop &= t[:, TYPICAL : TYPICAL + 1] < 1
        drop.scatter_(1, order[:, :1], False)  # the closest token always stays
        y = y.masked_fill(drop, float("-inf"))
    return x, y


class Sampler:
    """Rank 0's sampler: per-slot history for the penalties, and the batched pass."""

    def __init__(self, *, slots: int, vocab_size: int, eos_token_id: int, device,
                 offloaded: bool = False, rows_cap: int = 0):  # fmt: skip
        self.vocab_size, self.eos, self.device = vocab_size, eos_token_id, device
        # Rows a pass (memory.chunk_rows): fewer with blocks in host memory, at most rows_cap
        self.pass_rows = chunk_rows(vocab_size, offloaded=offloaded, cap=rows_cap)
        self.seen = torch.zeros((slots, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((slots, vocab_size), dtype=torch.int32, device=device)
        self.width = 3 + 2 * MAX_TOP_N

    def admit(self, slot: int, prompt_ids: list[int], params: SamplingParams, *,
              generated: list[int] = ()) -> None:  # fmt: skip
        """A request takes `slot`: its history starts from its prompt and what it generated
        before (a preempted request), queued on the device after every earlier step, so a step
        still in flight for the slot's last request cannot disturb it."""
        if params.uses_history:
            self.seen[slot].zero_()
            self.seen[slot, to_device(prompt_ids, self.device)] = True
            self.counts[slot].zero_()
            if generated:
                ids = to_device(list(generated), self.device)
                self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def sample(self, logits: torch.Tensor, rows: list[Row]):
        """(slots (n,), tokens (n,) long, packed (n, 3 + 2 * MAX_TOP_N) float32), all on the
        device; slots and tokens are the next decode inputs; `packed` holds per row the
        token, its log-probability, 1.0 if the row's distribution was finite, then the top
        alternatives' ids and log-probabilities (token ids are exact in float32 below 2^24).
        Rows go through in chunks of `chunk_rows(V)`: the pass's float32 temporaries are a few
        dozen bytes per logit, so its memory stays bounded at any batch (rows are independent:
        a row's token does not depend on the chunk it is in)."""
        step = self.pass_rows
        if len(rows) <= step:
            return self._sample(logits, rows)
        parts = [self._sample(logits[at : at + step], rows[at : at + step])
                 for at in range(0, len(rows), step)]  # fmt: skip
        return tuple(torch.cat(p) for p in zip(*parts))

    def _sample(self, logits: torch.Tensor, rows: list[Row]):
        n = len(rows)
        x = logits.float()
        host, needs = row_table(rows, self.vocab_size)
        t = to_device(host, self.device)
        slots = to_device([r.slot for r in rows], self.device)
        seen = self.seen[slots] if needs.history else None
        counts = self.counts[slots] if needs.history else None
        penalized, processed = process_logits(x, t, needs, seen=seen, counts=counts,
                                              eos_token_id=self.eos)  # fmt: skip
        tokens = penalized.argmax(-1)
        if not all(r.params.greedy for r in rows):
            sampled = draw(processed, t[:, U])
            tokens = torch.where(t[:, GREEDY] > 0, tokens, sampled)
        lse = x.logsumexp(-1)
        # A row is usable when its raw and its processed distributions are finite (one and
        # the same when no processor touched the logits).
        finite = torch.isfinite(lse)
        if processed is not x:
            finite &= torch.isfinite(processed.logsumexp(-1))
        out = torch.zeros((n, self.width), dtype=torch.float32, device=self.device)
        out[:, 0] = tokens.float()
        out[:, 1] = x.gather(1, tokens[:, None])[:, 0] - lse
        out[:, 2] = finite.float()
        k = max(r.params.top_n for r in rows)
        if k:
            top = x.topk(k, dim=-1)
            out[:, 3 : 3 + k] = top.indices.float()
            out[:, 3 + MAX_TOP_N : 3 + MAX_TOP_N + k] = top.values - lse[:, None]
        for i, r in enumerate(rows):  # rows that name their alternatives (few: a loop)
            ids = r.params.logprob_token_ids
            if ids:
                at = to_device(list(ids), self.device)
                out[i, 3 : 3 + len(ids)] = at.float()
                out[i, 3 + MAX_TOP_N : 3 + MAX_TOP_N + len(ids)] = x[i, at] - lse[i]
        if needs.history:
            self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                   accumulate=True)  # fmt: skip
        return slots, tokens, out


def prompt_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Log-probabilities of `targets` (T,) under `logits` (T, V), their ranks (1 + how many
    tokens are more likely) and the top k alternatives: (lp (T,), rank (T,), top ids (T, k),
    top lps (T, k)), all on the device."""
    x = logits.float()
    lse = x.logsumexp(-1)
    target = x.gather(1, targets[:, None])
    lp = target[:, 0] - lse
    rank = (x > target).sum(-1) + 1
    if k:
        top = x.topk(k, dim=-1)
        return lp, rank, top.indices, top.values - lse[:, None]
    return lp, rank, None, None
