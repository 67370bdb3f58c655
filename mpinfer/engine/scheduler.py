"""What rank 0's engine runs next: admission into the KV cache's rows and blocks, preemption
when the blocks run out, and the plan of each step. An object the engine holds, built from what
it needs (a block manager, the rows, the prompt budget, how to make a sequence); it knows no
model, no sampler and no threads beyond its lock, so its tests need none.

    schedule()  admit, then plan: returns a `StepPlan` (the step, the rows it samples, the
                requests it ends, the sequences admitted, those preempted, the queued requests
                cancelled before they started); the engine runs the step and hands the results
                back to the sequences
    admit       preempted sequences first (oldest first), then queued jobs, while a row is free
                and the pool has blocks for the whole prompt (its cached prefix reused,
                blocks.py); between client requests fairly: the next row goes to the group (one
                request's prompts x n x best_of) with the fewest jobs running
    plan        every sequence past its prompt decodes one token (a new block when it crosses a
                block boundary); the prompts' next chunks fill up to `max_prefill_tokens`
    preempt     when a decode needs a block and none is left, the newest sequence leaves the
                cache (its blocks go back) and is admitted again later, recomputing its prompt
                and what it generated as one prompt; its answer is the same, only later

What is not here: the blocks' bookkeeping (blocks.py), running a step (runner.py), when a
sequence stops (request.py's `stop_reason`, `wants_token`).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..model.steps import prompt_budget
from .blocks import BlockManager
from .request import Request, Sequence, wants_token
from .step import STEP, Prefill, Step

log = logging.getLogger("mpinfer")


@dataclass
class StepPlan:
    """One step and what it changed: `rows` (sequence, token index) in the order the runner
    returns their logits (decode rows, then each sampling prefill); `ends` the requests whose
    last planned work is in this step (prompt log-probabilities only); `admitted` the sequences
    that took a row (preempted ones coming back included); `preempted` those that left the
    cache; `cancelled` queued requests cancelled before they started."""

    step: Step
    rows: list[tuple[Sequence, int]] = field(default_factory=list)
    ends: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    cancelled: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.step.decode_slots or self.step.prefills)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, rows: int, max_prefill_tokens: int,
                 new_sequence: Callable[[Request], Sequence],
                 prefill_hold_steps: int = 0, max_step_tokens: int = 0):  # fmt: skip
        self.blocks, self.new_sequence = blocks, new_sequence
        self.free = list(range(rows))
        self.max_prefill_tokens, self.prefill_hold_steps = max_prefill_tokens, prefill_hold_steps
        self.max_step_tokens = max_step_tokens  # a step's tokens, decode rows included (steps.py)
        self.held = 0  # steps the waiting prompts have been held back (prefill_hold_steps)
        self.running: dict[int, Sequence] = {}
        self.preempted: list[Sequence] = []  # out of the cache, to be admitted again first
        self.pending: collections.deque[Request] = collections.deque()
        self.cond = threading.Condition()

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.running or self.preempted)

    def live(self) -> list[Sequence]:
        """Every started sequence: in the cache or preempted."""
        return list(self.running.values()) + self.preempted

    def schedule(self) -> StepPlan:
        """The next step: admissions, then the plan (see the module docstring)."""
        plan = StepPlan(Step(STEP))
        self._admit(plan)
        self._plan(plan)
        return plan

    def _admit(self, plan: StepPlan) -> None:
        """Preempted sequences first (oldest first), then queued jobs, into free rows while the
        pool has blocks for their prompts; queued jobs fairly between client requests: the next
        row goes to the group with the fewest jobs running, the earliest first among equals; one
        request's fan-out cannot hold back another's. Whoever is next and does not fit waits,
        and so does everyone behind it."""
        with self.cond:
            while self.preempted and self.free:
                s = self.preempted[0]
                if s.in_flight:  # its last token is still on the way: recompute after it
                    break
                if not self._place(s, s.tokens()):
                    return
                self.preempted.pop(0)
                plan.admitted.append(s)
            if self.preempted:
                return
            running = collections.Counter(s.req.group for s in self.running.values())
            waiting: dict[int, collections.deque] = {}
            for req in self.pending:
                if req.cancelled:
                    plan.cancelled.append(req)
                else:
                    waiting.setdefault(req.group, collections.deque()).append(req)
            while self.free and waiting:
                group = min(waiting, key=lambda g: (running[g], g))
                req = waiting[group][0]
                s = self.new_sequence(req)
                if not self._place(s, req.prompt_ids):
                    break
                waiting[group].popleft()
                if not waiting[group]:
                    del waiting[group]
                running[group] += 1
                plan.admitted.append(s)
            admitted = {id(s.req) for s in self.running.values()}
            self.pending = collections.deque(
                r for r in self.pending if not r.cancelled and id(r) not in admitted
            )

    def _place(self, s: Sequence, tokens: list[int]) -> bool:
        """`s` into the first free row with blocks for `tokens` (False: the pool is short)."""
        if not self.blocks.admit(s, tokens, self.free[0], busy=bool(self.running)):
            return False
        self.free.pop(0)
        self.running[s.slot] = s
        return True

    def _preempt(self, s: Sequence, plan: StepPlan) -> None:
        """Out of the cache to make room: its blocks go back, and it is admitted again (before
        anything queued) to recompute its prompt and what it generated, then goes on."""
        self.blocks.release(s)
        self.blocks.preemptions += 1
        with self.cond:
            del self.running[s.slot]
            self.free.append(s.slot)
            self.free.sort()
            s.slot = -1
            self.preempted.append(s)
            self.preempted.sort(key=lambda q: q.req.id)
        plan.preempted.append(s)
        log.info("request %d preempted (KV cache full), %d tokens to recompute", s.req.id,
                 len(s.tokens()))  # fmt: skip

    def _plan(self, plan: StepPlan) -> None:
        """The step's decode rows and prompt chunks, and the rows it samples (in the order the
        runner returns their logits: decode rows first, then the prefills)."""
        seqs = sorted(self.running.values(), key=lambda s: s.req.id)
        slots, positions = [], []
        for s in [s for s in seqs if s.decodable]:
            if s.slot < 0:  # preempted for an older one's block
                continue
            while not self.blocks.grow(s, s.pos + 1):
                self._preempt(max(self.running.values(), key=lambda q: q.req.id), plan)
                if s.slot < 0:
                    break
            if s.slot < 0:
                continue
            slots.append(s.slot)
            positions.append(s.pos)
            plan.rows.append((s, s.scheduled))
            s.pos += 1
            s.scheduled += 1
        prefills = []
        budget = prompt_budget(len(slots), self.max_prefill_tokens, self.max_step_tokens)
        # While rows decode, a prompt that would fill little of the budget may wait a few steps
        # for more to join it: each mixed step costs a pass at prefill speed, so fewer, fuller
        # ones serve the same prompts sooner overall (never when nothing decodes).
        waiting = sum(len(s.prompt_left) for s in seqs if not s.done)
        started = any(s.prompt_left and s.pos for s in seqs if not s.done)  # never mid-prompt
        if slots and waiting < budget and not started and self.held < self.prefill_hold_steps:
            self.held += 1
            budget = 0
        elif waiting:
            self.held = 0
        for s in seqs:
            if s.done or s.slot < 0 or not s.prompt_left or budget <= 0:
                continue
            chunk = s.prompt_left[: max(budget, 1)]
            last = len(chunk) == len(s.prompt_left)
            params = s.req.params
            sample = last and wants_token(s.scheduled, params)
            prefills.append(Prefill(s.slot, s.pos, tuple(chunk), sample, params.prompt_logprobs,
                                    -1 if last else s.prompt_left[len(chunk)]))  # fmt: skip
            s.pos += len(chunk)
            del s.prompt_left[: len(chunk)]
            budget -= len(chunk)
            self.blocks.commit(s, s.pos - len(chunk))
            if sample:
                plan.rows.append((s, s.scheduled))
                s.scheduled += 1
            elif last:
                plan.ends.append(s)
        plan.step = Step(STEP, tuple(slots), tuple(positions), tuple(prefills))

    def leave(self, s: Sequence) -> None:
        """A finished sequence gives back its row and blocks (or leaves the preempted list)."""
        with self.cond:
            if s.slot >= 0:
                del self.running[s.slot]
                self.free.append(s.slot)
                self.free.sort()
                self.blocks.release(s)
            else:
                self.preempted.remove(s)

    def reset(self, blocks: BlockManager) -> None:
        """A new block pool (nothing may be running: runner.fit_cache's)."""
        assert not self.busy, "the KV pool changed under running sequences"
        self.blocks = blocks
