"""What rank 0's engine runs next: admission into the KV cache's rows and blocks, preemption
when the blocks run out, and the plan of each step.

    admit    preempted sequences first (oldest first), then queued jobs, while a row is free and
             the pool has blocks for the whole prompt (its cached prefix reused, blocks.py);
             between client requests fairly: the next row goes to the group (one request's
             prompts x n x best_of) with the fewest jobs running
    plan     every sequence past its prompt decodes one token (a new block when it crosses a
             block boundary); the prompts' next chunks fill up to `max_prefill_tokens`
    preempt  when a decode needs a block and none is left, the newest sequence leaves the cache
             (its blocks go back) and is admitted again later, recomputing its prompt and what it
             generated as one prompt; its answer is the same, only later

`Engine` (engine.py) is a Scheduler: it adds the threads, the step loop, sampling and results.
What is not here: the blocks' bookkeeping (blocks.py), running a step (runner.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from .blocks import BlockManager
from .request import Event, Request, Result, Sequence, notify
from .runner import ModelRunner
from .step import STEP, Prefill, Step

log = logging.getLogger("mpinfer")


class Scheduler:
    def __init__(self, runner: ModelRunner, *, prefix_caching: bool = True):
        self.free = list(range(runner.slots))
        self.prefix_caching = prefix_caching
        self.reset_blocks(runner)
        self.running: dict[int, Sequence] = {}
        self.preempted: list[Sequence] = []  # out of the cache, to be admitted again first
        self.pending: collections.deque[Request] = collections.deque()
        self.cond = threading.Condition()

    def reset_blocks(self, runner: ModelRunner) -> None:
        """The block bookkeeping of the runner's KV pool, empty (nothing may be running)."""
        self.blocks = BlockManager(runner.num_blocks, runner.block_size,
                                   blocks_per_row=runner.blocks_per_row,
                                   prefix_caching=self.prefix_caching)  # fmt: skip

    def _admit(self) -> None:
        """Preempted sequences first (oldest first), then queued jobs, into free rows while the
        pool has blocks for their prompts; queued jobs fairly between client requests: the next
        row goes to the group (one request's prompts x n x best_of) with the fewest jobs
        running, the earliest first among equals; one request's fan-out cannot hold back
        another's. Whoever is next and does not fit waits, and so does everyone behind it."""
        with self.cond:
            while self.preempted and self.free:
                s = self.preempted[0]
                if s.in_flight:  # its last token is still on the way: recompute after it
                    break
                if not self._place(s, s.tokens()):
                    return
                self.preempted.pop(0)
                self.sampler.admit(s.slot, s.req.prompt_ids, s.req.params,
                                   generated=s.result.token_ids)  # fmt: skip
            if self.preempted:
                return
            running = collections.Counter(s.req.group for s in self.running.values())
            waiting: dict[int, collections.deque] = {}
            for req in self.pending:
                if req.cancelled:
                    self._finish_unstarted(req)
                else:
                    waiting.setdefault(req.group, collections.deque()).append(req)
            while self.free and waiting:
                group = min(waiting, key=lambda g: (running[g], g))
                req = waiting[group][0]
                s = Sequence(req, -1, self.tok)
                if not self._place(s, req.prompt_ids):
                    break
                waiting[group].popleft()
                if not waiting[group]:
                    del waiting[group]
                running[group] += 1
                self.sampler.admit(s.slot, req.prompt_ids, req.params)
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

    def _preempt(self, s: Sequence) -> None:
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
        log.info("request %d preempted (KV cache full), %d tokens to recompute", s.req.id,
                 len(s.tokens()))  # fmt: skip

    def _finish_unstarted(self, req: Request) -> None:
        result = Result(list(req.prompt_ids), finish_reason="cancelled", seed=req.params.seed)
        result.latency_s = time.perf_counter() - req.arrival
        notify(req, Event("done", result=result))

    def _plan(self) -> tuple[Step, list[tuple[Sequence, int]], list[Sequence]]:
        """The next step, the rows it samples (sequence, token index), and the requests that
        end with it (prompt log-probabilities only)."""
        seqs = sorted(self.running.values(), key=lambda s: s.req.id)
        rows, ends = [], []
        slots, positions = [], []
        for s in [s for s in seqs if s.decodable]:
            if s.slot < 0:  # preempted for an older one's block
                continue
            while not self.blocks.grow(s, s.pos + 1):
                self._preempt(max(self.running.values(), key=lambda q: q.req.id))
                if s.slot < 0:
                    break
            if s.slot < 0:
                continue
            slots.append(s.slot)
            positions.append(s.pos)
            rows.append((s, s.scheduled))
            s.pos += 1
            s.scheduled += 1
        prefills, budget = [], self.max_prefill_tokens
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
            sample = last and s.scheduled < params.max_new_tokens
            prefills.append(Prefill(s.slot, s.pos, tuple(chunk), sample, params.prompt_logprobs,
                                    -1 if last else s.prompt_left[len(chunk)]))  # fmt: skip
            s.pos += len(chunk)
            del s.prompt_left[: len(chunk)]
            budget -= len(chunk)
            self.blocks.commit(s, s.pos - len(chunk))
            if sample:
                rows.append((s, s.scheduled))
                s.scheduled += 1
            elif last:
                ends.append(s)
        # The runner returns decode rows first, then the prefills in order: so are `rows`.
        return Step(STEP, tuple(slots), tuple(positions), tuple(prefills)), rows, ends

    def _leave(self, s: Sequence) -> None:
        """A finished sequence gives back its row and blocks (or leaves the preempted list)."""
        with self.cond:
            if s.slot >= 0:
                del self.running[s.slot]
                self.free.append(s.slot)
                self.free.sort()
                self.blocks.release(s)
            else:
                self.preempted.remove(s)
