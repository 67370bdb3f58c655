"""The generation engine: continuous batching over the static KV cache's slots.

Rank 0 owns a bounded request queue and the scheduler; every other rank runs `worker_loop`.
Each step rank 0 admits queued requests into free slots, plans which slots decode one token and
which prefill the next chunk of their prompt (at most `max_prefill_tokens` prompt tokens a step,
so a long prompt does not stall running decodes), and broadcasts that small plan. All ranks run
the same forwards; rank 0 samples, detokenizes, checks stop conditions and hands events to each
request's sink. A request that finishes or is cancelled frees its slot for the next step. When
nothing is running rank 0 sends a heartbeat now and then, so idle workers never reach the
process group's timeout; a stop plan ends every loop.

Events reach a request through its `sink` callable, called on rank 0's engine thread: the server
wraps it into its event loop, the CLI and the REPL into a plain queue. What is not here: HTTP
(server.py), terminal I/O (repl.py), logits processing (generation.py).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .detok import TextStream
from .dist import DistContext, broadcast_object
from .generation import RowSampler, SamplingParams
from .kernels import ROW_BUCKETS
from .loader import LoadedModel
from .model import KVCache

log = logging.getLogger("mpinfer")


class QueueFull(Exception):
    """The request queue holds `max_queue` requests already (HTTP 429)."""


class EngineFailed(Exception):
    """The engine stopped after an error, or is shutting down (HTTP 503)."""


@dataclass(frozen=True)
class Plan:
    """One step, identical on every rank. kind: "step" | "idle" | "stop"."""

    kind: str = "step"
    decode_slots: tuple[int, ...] = ()
    decode_tokens: tuple[int, ...] = ()
    decode_pos: tuple[int, ...] = ()
    prefills: tuple[tuple[int, tuple[int, ...], int], ...] = ()  # (slot, chunk, start position)


@dataclass
class Result:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # length | stop | eos | cancelled | error
    logprobs: list[float] = field(default_factory=list)
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
    result: Result | None = None
    error: str = ""


class Request:
    _ids = itertools.count()

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None]
    ):  # noqa: E501
        self.id = next(self._ids)
        self.prompt_ids, self.params, self.sink = list(prompt_ids), params, sink
        self.arrival = time.perf_counter()
        self.cancelled = False


class _Seq:
    """A request in a slot (rank 0's bookkeeping)."""

    def __init__(self, req: Request, slot: int, tokenizer, device):
        self.req, self.slot = req, slot
        self.prompt_left = list(req.prompt_ids)
        self.pos = 0  # tokens already in this slot's cache
        self.next_input: int | None = None
        self.sampler = RowSampler(req.prompt_ids, req.params, device)
        self.stream = TextStream(tokenizer, req.params.stop)
        self.result = Result(list(req.prompt_ids))


def execute(model, cache: KVCache, plan: Plan, device) -> tuple[torch.Tensor | None, list]:
    """Run a plan's forwards on this rank: decode logits (n, V) and each prefill's last logits."""
    decode_logits = None
    if plan.decode_slots:
        pos = torch.tensor(plan.decode_pos, device=device)
        decode_logits = model(
            torch.tensor(plan.decode_tokens, device=device)[:, None],
            cache,
            slots=torch.tensor(plan.decode_slots, device=device),
            start_pos=pos,
            valid_from=torch.zeros_like(pos),
            kv_len=max(plan.decode_pos) + 1,
        )
    prefill_logits = []
    for slot, chunk, start in plan.prefills:
        prefill_logits.append(
            model(
                torch.tensor([chunk], device=device),
                cache,
                slots=torch.tensor([slot], device=device),
                start_pos=torch.tensor([start], device=device),
                valid_from=torch.zeros(1, dtype=torch.long, device=device),
                kv_len=start + len(chunk),
            )[0]
        )
    return decode_logits, prefill_logits


def allocate_cache(loaded: LoadedModel, slots: int, max_seq: int) -> KVCache:
    """The KV cache, then one warm-up decode step per row bucket of the int8 kernels
    (kernels.ROW_BUCKETS: 1, 2-16, 17-32, 33-64 rows), so autotuning and compilation happen at
    start-up, not on the first requests. Every rank calls this at the same point, so the steps'
    collectives pair up. The steps write position 0 of the first slots; a request's prefill
    overwrites it before any read."""
    cache = KVCache.allocate(
        loaded.shape, loaded.tp.tp_size, slots=slots, max_seq=max_seq,
        dtype=loaded.dtype, device=loaded.device,
    )  # fmt: skip
    for rows in [1] + [b + 1 for b in ROW_BUCKETS[:-1]]:  # each bucket's smallest row count
        if rows > slots:
            break
        ids = torch.zeros((rows, 1), dtype=torch.long, device=loaded.device)
        zeros = torch.zeros(rows, dtype=torch.long, device=loaded.device)
        slot_ids = torch.arange(rows, device=loaded.device)
        loaded.model(ids, cache, slots=slot_ids, start_pos=zeros, valid_from=zeros, kv_len=1)
    return cache


def worker_loop(loaded: LoadedModel, ctx: DistContext, slots: int, max_seq: int) -> None:
    """Ranks other than 0: run whatever rank 0 plans until it says stop."""
    cache = allocate_cache(loaded, slots, max_seq)
    while True:
        plan: Plan = broadcast_object(None, ctx)
        if plan.kind == "stop":
            return
        if plan.kind == "step":
            execute(loaded.model, cache, plan, loaded.device)


def server_worker_loop(loaded: LoadedModel, ctx: DistContext, cfg) -> None:
    """`worker_loop` with the cache a server config gives (what `Engine.from_config` builds on
    rank 0; memory.kv_slots is a collective, so both sides call it at the same point)."""
    from .memory import kv_slots

    worker_loop(loaded, ctx, kv_slots(loaded, cfg, ctx), cfg.server.max_seq_len)


class Engine:
    @classmethod
    def from_config(cls, loaded: LoadedModel, ctx: DistContext, tokenizer, cfg) -> Engine:
        """Rank 0's engine as the server config describes it: its queue and prefill limits,
        and as many KV slots as server.max_batch_slots asks for and the GPU holds."""
        from .memory import kv_slots

        s = cfg.server
        return cls(loaded, ctx, tokenizer, slots=kv_slots(loaded, cfg, ctx),
                   max_seq=s.max_seq_len, max_queue=s.max_queue,
                   max_prefill_tokens=s.max_prefill_tokens)  # fmt: skip

    def __init__(
        self, loaded: LoadedModel, ctx: DistContext, tokenizer, *, slots: int, max_seq: int,
        max_queue: int = 128, max_prefill_tokens: int = 512, heartbeat_s: float = 1.0,
    ):  # fmt: skip
        assert ctx.is_rank0
        self.loaded, self.ctx, self.tok = loaded, ctx, tokenizer
        self.max_seq, self.max_queue = max_seq, max_queue
        self.max_prefill_tokens, self.heartbeat_s = max_prefill_tokens, heartbeat_s
        self.cache = allocate_cache(loaded, slots, max_seq)
        self.free = list(range(slots))
        self.running: dict[int, _Seq] = {}
        self.pending: collections.deque[Request] = collections.deque()
        self.cond = threading.Condition()
        self.steps = 0
        self.generated_tokens = 0
        self.stopping = False
        self.failed = ""

    # -- any thread -----------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A ValueError naming what is wrong with a request, before it is queued."""
        params.check()
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        if len(prompt_ids) + params.max_new_tokens > self.max_seq:
            raise ValueError(
                f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {len(prompt_ids) + params.max_new_tokens} exceeds "
                f"max_seq_len={self.max_seq}"
            )

    def submit(self, prompt_ids, params: SamplingParams, sink: Callable[[Event], None]) -> Request:
        self.check(prompt_ids, params)
        req = Request(prompt_ids, params, sink)
        with self.cond:
            if self.failed or self.stopping:
                raise EngineFailed(self.failed or "the server is shutting down")
            if len(self.pending) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            self.pending.append(req)
            self.cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        with self.cond:
            req.cancelled = True
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    @property
    def running_slots(self) -> int:
        return len(self.running)

    # -- rank 0's engine thread ------------------------------------------------------------------
    def run(self, *, until_idle: bool = False) -> None:
        """Serve until stop() (or, with until_idle, until nothing is queued or running)."""
        try:
            while True:
                with self.cond:
                    if not (self.pending or self.running or self.stopping):
                        if until_idle:
                            break
                        self.cond.wait(self.heartbeat_s)
                    if self.stopping and not self.pending and not self.running:
                        break
                    busy = bool(self.pending or self.running)
                if busy:
                    self.step()
                else:
                    broadcast_object(Plan("idle"), self.ctx)
        except BaseException as e:
            self._fail(f"{type(e).__name__}: {e}")
            raise
        broadcast_object(Plan("stop"), self.ctx)

    def cancel_all(self, reason: str = "cancelled") -> None:
        """Cancel every queued and running request (shutdown past its timeout)."""
        with self.cond:
            for req in list(self.pending) + [s.req for s in self.running.values()]:
                req.cancelled = True
            self.cond.notify()

    def _fail(self, error: str) -> None:
        with self.cond:
            self.failed = error
            reqs = list(self.pending) + [s.req for s in self.running.values()]
            self.pending.clear()
            self.running.clear()
        log.error("engine failed: %s", error)
        for req in reqs:
            req.sink(Event("error", error=error))

    def _admit(self) -> None:
        with self.cond:
            keep = collections.deque()
            while self.pending:
                req = self.pending.popleft()
                if req.cancelled:
                    self._finish_unstarted(req)
                elif self.free:
                    slot = self.free.pop(0)
                    self.running[slot] = _Seq(req, slot, self.tok, self.loaded.device)
                else:
                    keep.append(req)
            self.pending = keep

    def _finish_unstarted(self, req: Request) -> None:
        result = Result(list(req.prompt_ids), finish_reason="cancelled")
        result.latency_s = time.perf_counter() - req.arrival
        req.sink(Event("done", result=result))

    def _plan(self) -> tuple[Plan, list[_Seq], list[_Seq]]:
        decode = [s for s in self.running.values() if s.next_input is not None]
        prefills, prefill_seqs, budget = [], [], self.max_prefill_tokens
        for s in sorted(self.running.values(), key=lambda s: s.req.id):
            if s.prompt_left and (budget > 0 or not prefills):
                chunk = s.prompt_left[: max(budget, 1)]
                prefills.append((s.slot, tuple(chunk), s.pos))
                prefill_seqs.append(s)
                budget -= len(chunk)
        plan = Plan(
            "step",
            tuple(s.slot for s in decode), tuple(s.next_input for s in decode),
            tuple(s.pos for s in decode), tuple(prefills),
        )  # fmt: skip
        return plan, decode, prefill_seqs

    def step(self) -> None:
        for s in [s for s in self.running.values() if s.req.cancelled]:
            self._finish(s, "cancelled")
        self._admit()
        if not self.running:
            return
        plan, decode, prefill_seqs = self._plan()
        broadcast_object(plan, self.ctx)
        model, device = self.loaded.model, self.loaded.device
        decode_logits, prefill_logits = execute(model, self.cache, plan, device)
        self.steps += 1
        for i, s in enumerate(decode):
            s.pos += 1
            self._sample(s, decode_logits[i])
        for (_, chunk, _), s, logits in zip(plan.prefills, prefill_seqs, prefill_logits):
            s.pos += len(chunk)
            del s.prompt_left[: len(chunk)]
            if not s.prompt_left:
                self._sample(s, logits)

    def _sample(self, s: _Seq, logits: torch.Tensor) -> None:
        token, logprob = s.sampler.next_token(logits)
        r = s.result
        if not r.token_ids:
            r.ttft_s, r.first_step = time.perf_counter() - s.req.arrival, self.steps
        r.token_ids.append(token)
        r.logprobs.append(logprob)
        self.generated_tokens += 1
        text = s.stream.add(token)
        reason = ""
        if token == self.loaded.shape.eos_token_id:
            reason = "eos"
        elif s.stream.stopped:
            reason = "stop"
        elif len(r.token_ids) >= s.req.params.max_new_tokens:
            reason = "length"
        if reason:
            text += s.stream.flush()  # the last token event carries all remaining text
        s.req.sink(Event("token", token_id=token, text=text, logprob=logprob))
        if reason:
            self._finish(s, reason)
        else:
            s.next_input = token

    def _finish(self, s: _Seq, reason: str) -> None:
        tail = s.stream.flush()  # non-empty only for a cancelled request
        r = s.result
        r.text, r.finish_reason = s.stream.text, reason
        r.latency_s, r.last_step = time.perf_counter() - s.req.arrival, self.steps
        with self.cond:
            del self.running[s.slot]
            self.free.append(s.slot)
            self.free.sort()
        s.req.sink(Event("done", text=tail, result=r))
