"""What a request is and what comes back from it: the types the engine and its faces share.

    Request   a prompt's token ids, its SamplingParams and the sink its events go to
    Event     token (one token and the text it adds) | done (with the Result) | error
    Result    everything generated: ids, text, finish reason, log-probabilities, timings
    QueueFull, EngineFailed   the two refusals of Engine.submit (HTTP 429, 503)

What is not here: how requests are scheduled (engine.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .sampling import SamplingParams


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
