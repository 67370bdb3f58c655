"""The generation engine on rank 0: a bounded queue, continuous batching over the KV cache's
blocks, and a step loop that keeps the GPU busy.

Each step the engine's `Scheduler` (scheduler.py, an object it holds) admits queued requests
into free rows and KV blocks, picks which rows decode one token and which prefill the next chunk
of their prompt (at most `max_prefill_tokens` prompt tokens a step, so a long prompt does not
stall running decodes), preempting the newest sequence when the blocks run out, and returns
that plan; the engine sends its `Step` to the other ranks, runs it (runner.py) and samples
every row in one batched pass (sampling.py).
The step's results come back to the host one step late: while the GPU runs step n+1, the host
turns step n's tokens into text, checks stop conditions and hands events to each request's sink.
A step never waits for the previous one's tokens: decode inputs stay on the device. The price: a
request that stops on EOS or a stop string has one more row computed that nobody reads.

Failures: an error while handling one request's results (a non-finite distribution, a stop or
detokenization fault) ends that request with an error event; the other requests go on. An error
in a forward or a collective ends the engine: every request gets an error, and the process
exits non-zero. When nothing runs, rank 0 sends an idle step now and then, so the other ranks
never reach the process group's timeout; a stop step ends their loops.

Events reach a request through its `sink` callable, called on the engine's thread: the server
moves them onto its event loop, the CLI and the REPL into a plain queue. What is not here: HTTP
(routes.py), terminal I/O (repl.py), start-up (runtime.py).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable

import torch

from ..dist import DistContext
from ..model.memory import PROMPT_LOGPROB_ROWS, decode_buckets
from .blocks import BlockManager
from .request import (
    EngineFailed,
    Event,
    InFlight,
    QueueFull,
    Request,
    Result,
    Sequence,
    notify,
    stop_reason,
)
from .runner import ModelRunner
from .sampling import MAX_TOP_N, Row, Sampler, SamplingParams, prompt_token_logprobs
from .scheduler import Scheduler
from .step import FIT, IDLE, STOP, Step

log = logging.getLogger("mpinfer")


class Engine:
    def __init__(
        self, runner: ModelRunner, ctx: DistContext, tokenizer, *, max_queue: int = 128,
        max_prefill_tokens: int = 512, heartbeat_s: float = 1.0, prefill_hold_steps: int = 0,
        sampler_rows: int = 0,
        prefix_caching: bool = True,
    ):  # fmt: skip
        assert ctx.is_rank0
        self.runner, self.ctx, self.tok = runner, ctx, tokenizer
        self.loaded = runner.loaded
        self.eos = self.loaded.shape.eos_token_id
        self.vocab_size = self.loaded.shape.vocab_size
        self.max_seq, self.max_queue = runner.max_seq, max_queue
        assert max_prefill_tokens <= runner.max_prefill_tokens, "the step channel is too small"
        self.max_prefill_tokens, self.heartbeat_s = max_prefill_tokens, heartbeat_s
        self.channel = runner.channel
        self.prefix_caching = prefix_caching
        self.sampler = Sampler(slots=runner.slots, vocab_size=self.vocab_size,
                               eos_token_id=self.eos, device=runner.device,
                               offloaded=runner.model.offload is not None,
                               rows_cap=sampler_rows)  # fmt: skip
        self.scheduler = Scheduler(self._block_manager(), rows=runner.slots,
                                   max_prefill_tokens=max_prefill_tokens,
                                   new_sequence=lambda req: Sequence(req, -1, self.tok),
                                   prefill_hold_steps=prefill_hold_steps,
                                   max_step_tokens=runner.max_step_tokens)  # fmt: skip
        self.cond = self.scheduler.cond  # the one lock of the queue and the rows
        self.steps = 0
        self.generated_tokens = 0
        self.failed_requests = 0
        self.stopping = False
        self.failed = ""
        self.progress_at = time.monotonic()  # the last time a step completed or it idled

    # -- any thread ------------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A ValueError naming what is wrong with a request, before it is queued."""
        params.check()
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        top, low = max(prompt_ids), min(prompt_ids)
        if top >= self.vocab_size or low < 0:  # vLLM's words, and the range
            bad = top if top >= self.vocab_size else low
            raise ValueError(f"prompt: Token id {bad} is out of vocabulary (token ids are "
                             f"[0, {self.vocab_size}))")  # fmt: skip
        if len(prompt_ids) + params.max_new_tokens > self.max_seq:
            raise ValueError(
                f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {len(prompt_ids) + params.max_new_tokens} exceeds "
                f"max_seq_len={self.max_seq}"
            )
        blocks = self.scheduler.blocks
        total, bs = blocks.pool.num_blocks, blocks.block_size
        if blocks.blocks_for(len(prompt_ids) + params.max_new_tokens) > total:
            raise ValueError(
                f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) needs more than the whole KV cache ({total} blocks "
                f"of {bs} = {total * bs} tokens)"
            )
        if params.max_new_tokens == 0 and params.prompt_logprobs < 0:
            raise ValueError(
                "max_new_tokens: 0 generates nothing; it needs prompt log-probabilities "
                "(echo with logprobs)"
            )

    def submit(self, prompt_ids, params: SamplingParams, sink: Callable[[Event], None]) -> Request:
        return self.submit_all([(prompt_ids, params, sink)])[0]

    def submit_all(self, jobs: list[tuple[list[int], SamplingParams, Callable]]) -> list[Request]:
        """One client request's jobs, queued together or not at all; admission shares the slots
        fairly between such groups (scheduler.py)."""
        reqs = []
        for prompt_ids, params, sink in jobs:
            self.check(prompt_ids, params)
            if params.seed is None:  # an unseeded request still reports the seed it used
                params = dataclasses.replace(params, seed=random.getrandbits(64))
            reqs.append(Request(prompt_ids, params, sink))
        with self.cond:
            if self.failed or self.stopping:
                raise EngineFailed(self.failed or "the server is shutting down")
            pending = self.scheduler.pending
            if len(pending) + len(reqs) > self.max_queue:
                need = f"; this request needs {len(reqs)} places" if len(reqs) > 1 else ""
                raise QueueFull(f"the request queue is full ({len(pending)} of "
                                f"{self.max_queue} waiting{need})")  # fmt: skip
            for r in reqs:
                r.group = reqs[0].id
            pending.extend(reqs)
            self.cond.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        with self.cond:
            req.cancelled = True
            self.cond.notify()

    def cancel_all(self) -> None:
        """Cancel every queued and running request (shutdown past its timeout)."""
        with self.cond:
            for req in list(self.scheduler.pending) + [s.req for s in self.live()]:
                req.cancelled = True
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def stalled_for(self) -> float:
        """Seconds since the last completed step while work is pending (0 when idle): a rank
        that stopped (SIGSTOP, a hung collective) shows here long before the group's timeout."""
        if not self.scheduler.busy:
            return 0.0
        return time.monotonic() - self.progress_at

    def live(self) -> list[Sequence]:
        """Every started sequence: in the cache or preempted."""
        return self.scheduler.live()

    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.pending) + len(self.scheduler.preempted)

    @property
    def running_slots(self) -> int:
        return len(self.scheduler.running)

    def _block_manager(self) -> BlockManager:
        r = self.runner
        return BlockManager(r.num_blocks, r.block_size, blocks_per_row=r.blocks_per_row,
                            prefix_caching=self.prefix_caching)  # fmt: skip

    # -- rank 0's engine thread ------------------------------------------------------------------
    def warm_up(self) -> None:
        """On a GPU, before ready: requests of every decode batch size, greedy and sampled,
        through the whole step: first-time costs (CUDA modules loaded on first launch, pinned
        buffers) are paid here, not by the first clients. The largest batch goes first, so the
        caching allocator holds what serving's largest sampler pass needs and no more (smaller
        batches reuse its blocks; growing batches would each leave their own behind), and
        `fit_cache` counts it. The other ranks run the steps."""
        if self.runner.device.type != "cuda":
            return
        t0 = time.perf_counter()
        pad = self.loaded.shape.pad_token_id
        kinds = [SamplingParams(max_new_tokens=2, ignore_eos=True),
                 SamplingParams(max_new_tokens=2, ignore_eos=True, do_sample=True,
                                temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                top_n=2)]  # fmt: skip
        for n in reversed(decode_buckets(self.runner.slots)):
            for i in range(n):
                self.submit([pad] * 3, kinds[i % 2], lambda ev: None)
            self.run(until_idle=True, stop_ranks=False)
        # The prompt log-probabilities' LM-head passes (eager, two runs of positions).
        echo = SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=1)
        long = min(self.max_seq - 1, PROMPT_LOGPROB_ROWS + 8, self.max_prefill_tokens)
        self.submit([pad] * long, echo, lambda ev: None)
        self.run(until_idle=True, stop_ranks=False)
        self.steps = self.generated_tokens = 0
        log.info("engine warm-up (sampler and step, up to %d rows) in %.1f s",
                 self.runner.slots, time.perf_counter() - t0)  # fmt: skip

    def fit_cache(self) -> None:
        """After warm_up, before serving: every rank sizes its KV pool from what its process
        holds (runner.fit_cache: the budget is the whole footprint nvidia-smi shows), and the
        scheduler takes the new pool's blocks."""
        if self.runner.fit is None or self.runner.device.type != "cuda":
            return
        self.channel.send(Step(FIT))
        self.runner.fit_cache()
        self.scheduler.reset(self._block_manager())

    def run(self, *, until_idle: bool = False, stop_ranks: bool = True) -> None:
        """Serve until stop() (or, with until_idle, until nothing is queued or running); then
        the other ranks' loops end (unless stop_ranks is false)."""
        inflight: InFlight | None = None
        try:
            while True:
                with self.cond:
                    if not (self.scheduler.busy or self.stopping or inflight):
                        if until_idle:
                            break
                        self.cond.wait(self.heartbeat_s)
                        self.progress_at = time.monotonic()
                        if not (self.scheduler.busy or self.stopping):
                            self.channel.send(Step(IDLE))  # keep the other ranks' waits short
                            continue
                    if self.stopping and not (self.scheduler.busy or inflight):
                        break
                launched = self._launch_next()
                if inflight is not None:
                    self._complete(inflight)
                if inflight is not None or launched is None:
                    self.progress_at = time.monotonic()
                inflight = launched
        except BaseException as e:
            self._fail(f"{type(e).__name__}: {e}")
            raise
        if stop_ranks:
            self.channel.send(Step(STOP))

    def _fail(self, error: str) -> None:
        with self.cond:
            self.failed = error
            sched = self.scheduler
            reqs = list(sched.pending) + [s.req for s in self.live()]
            sched.pending.clear()
            sched.running.clear()
            sched.preempted.clear()
        log.error("engine failed: %s", error)
        for req in reqs:
            notify(req, Event("error", error=error))

    def _launch_next(self) -> InFlight | None:
        """Admit, plan, send and launch the next step (None: nothing to run now)."""
        for s in [s for s in self.live() if s.req.cancelled]:
            self._finish(s, "cancelled")
        plan = self.scheduler.schedule()
        for req in plan.cancelled:
            self._finish_unstarted(req)
        for s in plan.admitted:  # the sampler's history: the prompt and what it generated
            self.sampler.admit(s.slot, s.req.prompt_ids, s.req.params,
                               generated=s.result.token_ids)  # fmt: skip
        if plan.empty:
            return None
        rows, ends = plan.rows, plan.ends
        step = dataclasses.replace(plan.step, table=self.scheduler.blocks.take_updates())
        self.channel.send(step)
        self.steps += 1
        prompt = []
        pf_seqs = [self.scheduler.running[p.slot] for p in step.prefills]

        def on_prompt_logits(i: int, offset: int, logits, targets) -> None:
            s = pf_seqs[i]
            got = prompt_token_logprobs(logits, targets.clamp(min=0), s.req.params.prompt_logprobs)
            # Position j of the chunk predicts prompt token start + j + 1.
            prompt.append((s, step.prefills[i].start + offset + 1, *got))

        logits = self.runner.execute(step, on_prompt_logits)
        packed, ready = None, None
        if rows:
            slots, tokens, out = self.sampler.sample(
                logits, [Row(s.slot, s.req.params, index) for s, index in rows]
            )
            self.runner.set_next_tokens(slots, tokens)
            packed = self._to_host(out)
        self.runner.share_next_tokens()
        if self.runner.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return InFlight(self.steps, [s for s, _ in rows], packed, ready, prompt, ends)

    def _to_host(self, out: torch.Tensor) -> torch.Tensor:
        if out.device.type != "cuda":
            return out
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        return host

    def _complete(self, f: InFlight) -> None:
        """Read a launched step's results (it ran while the next one was launched)."""
        if f.ready is not None:
            f.ready.synchronize()
        for s, at, *got in f.prompt:
            if s.done:
                continue
            self._guard(s, self._store_prompt_logprobs, s, at, *got)
        data = f.packed.tolist() if f.packed is not None else []
        for s, row in zip(f.rows, data):
            if not s.done:
                self._guard(s, self._deliver, s, row, f.index)
        for s in f.ends:
            if not s.done:
                self._finish(s, "length")

    def _guard(self, s: Sequence, fn, *args) -> None:
        """Run one request's part of a step; an error ends that request alone."""
        try:
            fn(*args)
        except Exception as e:  # any fault in one request's handling is that request's error
            log.exception("request %d failed", s.req.id)
            self._finish(s, "error", error=f"{type(e).__name__}: {e}")

    def _store_prompt_logprobs(self, s: Sequence, at: int, lp, rank, top_ids, top_lps) -> None:
        r, n = s.result, len(s.req.prompt_ids)
        values, ranks = lp.tolist(), rank.tolist()
        ids = top_ids.tolist() if top_ids is not None else None
        lps = top_lps.tolist() if top_lps is not None else None
        for j, v in enumerate(values):
            if at + j >= n:  # the last position predicts the first generated token
                break
            r.prompt_logprobs[at + j] = v
            r.prompt_ranks[at + j] = ranks[j]
            r.prompt_top_logprobs[at + j] = list(zip(ids[j], lps[j])) if ids is not None else []

    def _deliver(self, s: Sequence, row: list[float], step_index: int) -> None:
        token, logprob, finite = int(row[0]), row[1], row[2]
        if not finite:
            raise ValueError("the sampling distribution was not finite (NaN or infinite logits)")
        k = s.req.params.top_n
        top = tuple(zip(map(int, row[3 : 3 + k]), row[3 + MAX_TOP_N : 3 + MAX_TOP_N + k]))
        r = s.result
        if not r.token_ids:
            r.ttft_s, r.first_step = time.perf_counter() - s.req.arrival, step_index
        r.token_ids.append(token)
        r.logprobs.append(logprob)
        if k:
            r.top_logprobs.append(list(top))
        self.generated_tokens += 1
        text = s.stream.add(token)
        reason = stop_reason(token, len(r.token_ids), s.req.params, self.eos, s.stream.stopped)
        r.last_step = step_index
        if reason:
            text += s.stream.finish()  # the last token event carries all remaining text
        s.req.sink(Event("token", token_id=token, text=text, logprob=logprob, top=top))
        if reason:
            self._finish(s, reason)

    def _finish(self, s: Sequence, reason: str, *, error: str = "") -> None:
        s.done = True
        r = s.result
        tail = ""
        if reason != "error":
            tail = s.stream.finish()  # non-empty only for a cancelled request
        r.text, r.finish_reason = s.stream.text, reason
        r.latency_s = time.perf_counter() - s.req.arrival
        self.scheduler.leave(s)
        if reason == "error":
            self.failed_requests += 1
            notify(s.req, Event("error", error=error, result=r))
        else:
            notify(s.req, Event("done", text=tail, result=r))

    def _finish_unstarted(self, req: Request) -> None:
        """A queued request cancelled before it took a row."""
        result = Result(list(req.prompt_ids), finish_reason="cancelled", seed=req.params.seed)
        result.latency_s = time.perf_counter() - req.arrival
        notify(req, Event("done", result=result))
