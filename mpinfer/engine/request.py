"""What a request is and what comes back from it: the types the engine and its faces share.

    Request   a prompt's token ids, its SamplingParams and the sink its events go to
    Event     token (one token and the text it adds) | done (with the Result) | error
    Result    everything generated: ids, text, finish reason, log-probabilities, timings
    QueueFull, EngineFailed   the two refusals of Engine.submit (HTTP 429, 503)
    Sequence  a request in a cache slot (rank 0's bookkeeping)
    InFlight  a launched engine step whose results have not been read yet
    wants_token, stop_reason   the length rule and the one stop check (pure functions)

What is not here: how requests are scheduled (scheduler.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .detok import TextStream
from .sampling import SamplingParams

log = logging.getLogger("mpinfer")


class QueueFull(Exception):
    """The request queue holds `max_queue` requests already (HTTP 429)."""


class EngineFailed(Exception):
    """The engine stopped after an error, or is shutting down (HTTP 503)."""


@dataclass
class Result:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # length | stop | eos | cancelled | error
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # One entry per prompt token (None for the first), when the request asked for them.
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # 1: the most likely token
    seed: int | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0
    first_step: int = -1  # engine step that produced the first token
    last_step: int = -1


@dataclass(frozen=True)
class Event:
    kind: str  # "token" | "done" | "error"
    token_id: int = -1
    text: str = ""
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()
    result: Result | None = None
    error: str = ""


class Request:
    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams,
                 sink: Callable[[Event], None]):  # fmt: skip
        self.id = next(self._ids)
        self.prompt_ids, self.params, self.sink = list(prompt_ids), params, sink
        self.arrival = time.perf_counter()
        self.cancelled = False
        self.group = self.id  # the client request it belongs to (Engine.submit_all)


class Sequence:
    """A request in a slot (rank 0's bookkeeping). `pos` and `scheduled` count what has been
    planned; `result` what has come back. A preempted sequence has slot -1 and no blocks until
    it is admitted again, with its prompt and what it generated as the prompt to recompute."""

    def __init__(self, req: Request, slot: int, tokenizer):
        self.req, self.slot = req, slot
        self.prompt_left = list(req.prompt_ids)
        self.pos = 0  # cache positions planned so far
        self.scheduled = 0  # tokens whose sampling has been planned
        self.done = False
        self.blocks: list[int] = []  # the KV-cache blocks holding its positions, in order
        self.keys: list[bytes] = []  # the prefix-cache key of each full block it knows
        p = req.params
        self.stream = TextStream(tokenizer, p.stop, skip_special_tokens=p.skip_special_tokens,
                                 include_stop=p.include_stop_str_in_output)  # fmt: skip
        self.result = Result(list(req.prompt_ids), seed=req.params.seed)
        if req.params.prompt_logprobs >= 0:
            self.result.prompt_logprobs = [None] * len(req.prompt_ids)
            self.result.prompt_top_logprobs = [None] * len(req.prompt_ids)
            self.result.prompt_ranks = [None] * len(req.prompt_ids)

    def tokens(self) -> list[int]:
        """What its cache has to hold before it can go on: prompt and generated tokens."""
        return self.req.prompt_ids + self.result.token_ids

    @property
    def in_flight(self) -> bool:
        """A token has been planned whose result has not come back yet."""
        return self.scheduled > len(self.result.token_ids)

    @property
    def decodable(self) -> bool:
        return (not self.done and not self.prompt_left and self.scheduled > 0
                and wants_token(self.scheduled, self.req.params))  # fmt: skip


def wants_token(count: int, params) -> bool:
    """The length rule, in one place: a sequence with `count` tokens generated (or planned) may
    have another while it is under max_new_tokens."""
    return count < params.max_new_tokens


def stop_reason(token: int, count: int, params, eos: int, stopped_by_text: bool) -> str:
    """Why a sequence ends with `token`, its `count`-th generated token ("" if it goes on): its
    EOS ("eos", unless ignore_eos; the sampler holds EOS back before min_tokens), a stop string
    the detokenizer found or a stop token id past min_tokens ("stop"), max_new_tokens
    ("length"). A pure function of its arguments: the engine's only stop check."""
    if token == eos and not params.ignore_eos:
        return "eos"
    if stopped_by_text or (token in params.stop_token_ids and count > params.min_tokens):
        return "stop"
    return "" if wants_token(count, params) else "length"


@dataclass
class InFlight:
    """A launched step whose results have not been read yet."""

    index: int
    rows: list[Sequence]
    packed: torch.Tensor | None  # (rows, width) float32 on the host once `ready` has fired
    ready: torch.cuda.Event | None
    # (sequence, first prompt position, lp (r,), top ids (r, k) | None, top lps (r, k) | None)
    prompt: list[tuple[Sequence, int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    ends: list[Sequence]  # requests whose last planned work is in this step (max_new_tokens 0)


def notify(req: Request, ev: Event) -> None:
    """A request's last event: a sink that fails here has nobody left to tell but the log."""
    try:
        req.sink(ev)
    except Exception:  # the request is over either way; the engine must go on
        log.exception("request %d: its sink failed on its %s event", req.id, ev.kind)
