"""The bridge between the HTTP routes and the engine, on rank 0: what the routes share (`State`),
engine events carried onto the event loop (`Dispatcher`), and one HTTP request's jobs in the
engine (`Submission`: submitted together, their events merged into one queue, cancelled
together when the client goes away or one of them fails).

The engine calls a request's sink on its own thread; the dispatcher collects those events and
schedules one flush on the event loop per batch of them (one wake-up of the loop per engine step,
not one per token). What is not here: the routes (routes.py, tgi.py, oai.py), request parsing
(api.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..config import RunConfig
from ..engine.engine import Engine
from ..engine.request import EngineFailed, Event, QueueFull, Result
from .api import ApiError, Job, check_text, rename
from .chat import ChatTemplate

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics:
    """A prometheus_client collector: the engine's counters and gauges and the requests by
    route, read when /metrics is scraped (the engine keeps plain integers on its thread)."""

    def __init__(self, state: State):
        self.state = state

    def collect(self):
        e, st = self.state.engine, self.state
        for name, kind, doc, value in (
            ("mpinfer_queue_depth", GaugeMetricFamily, "requests waiting for a slot",
             e.queue_depth if e else 0),
            ("mpinfer_running_slots", GaugeMetricFamily, "requests in a KV-cache slot",
             e.running_slots if e else 0),
            ("mpinfer_generated_tokens", CounterMetricFamily, "tokens generated",
             e.generated_tokens if e else 0),
            ("mpinfer_engine_steps", CounterMetricFamily, "engine steps run", e.steps if e else 0),
            ("mpinfer_failed_requests", CounterMetricFamily, "requests ended by an error",
             e.failed_requests if e else 0),
            ("mpinfer_cancelled_requests", CounterMetricFamily,
             "requests whose client went away", st.cancelled),
            ("mpinfer_dropped_streams", CounterMetricFamily,
             "streams cancelled because their client did not read them", st.dropped_streams),
            ("mpinfer_kv_blocks_used", GaugeMetricFamily, "KV-cache blocks held by sequences",
             e.scheduler.blocks.pool.used if e else 0),
            ("mpinfer_kv_blocks_free", GaugeMetricFamily,
             "KV-cache blocks free (cached prefixes nobody holds included)",
             e.scheduler.blocks.pool.available if e else 0),
            ("mpinfer_prefix_cache_queried_tokens", CounterMetricFamily,
             "prompt tokens looked up in the prefix cache",
             e.scheduler.blocks.prompt_tokens if e else 0),
            ("mpinfer_prefix_cache_hit_tokens", CounterMetricFamily,
             "prompt tokens found in the prefix cache (not computed)",
             e.scheduler.blocks.cached_tokens if e else 0),
            ("mpinfer_preemptions", CounterMetricFamily,
             "sequences sent out of the KV cache to be recomputed later",
             e.scheduler.blocks.preemptions if e else 0),
        ):  # fmt: skip
            if name.startswith("mpinfer_prefix_cache_") and not st.cfg.server.prefix_cache_metrics:
                continue
            yield kind(name, doc, value=value)
        closed = CounterMetricFamily("mpinfer_connections_closed", "connections the server "
                                     "closed, by reason: idle, slow_request (the body did not "
                                     "arrive in time), evicted (at the cap), over_cap",
                                     labels=["reason"])  # fmt: skip
        for reason, n in sorted(st.closed_connections.items()):
            closed.add_metric([reason], n)
        yield closed
        requests = CounterMetricFamily("mpinfer_requests", "answered requests by route template "
                                       "and status", labels=["route", "status"])  # fmt: skip
        with st.lock:
            for (route, status), n in sorted(st.requests.items()):
                requests.add_metric([route, str(status)], n)
        yield requests


class Dispatcher:
    """Engine events onto the event loop: the engine thread appends (queue, tag, event), and
    the first append after a flush schedules one flush on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False

    def sink(self, queue: asyncio.Queue, tag: int, overflow=None):
        """The engine's callback for one job's events; `overflow(size)` runs on the loop after
        each event put in the job's queue (its size then)."""

        def put(ev: Event) -> None:
            with self.lock:
                self.items.append((queue, tag, ev, overflow))
                if self.scheduled:
                    return
                self.scheduled = True
            self.loop.call_soon_threadsafe(self.flush)

        return put

    def flush(self) -> None:
        with self.lock:
            items, self.items = self.items, collections.deque()
            self.scheduled = False
        for queue, tag, ev, overflow in items:
            queue.put_nowait((tag, ev))
            if overflow is not None:
                overflow(queue.qsize())


class State:
    """What the routes share: the engine once loaded, its status, and the metrics."""

    def __init__(self, cfg: RunConfig, *, model_name: str):
        self.cfg, self.model_name = cfg, model_name
        self.status = "loading"  # loading | ready | stopping | failed
        self.engine: Engine | None = None
        self.tokenizer = None
        self.chat: ChatTemplate | None = None
        self.info: dict = {}
        self.requests = defaultdict(int)  # (route, status) -> count
        self.paths: set[str] = set()  # the app's routes (build_app fills it)
        # A registry of this server's own (prometheus_client's default one is process-global):
        # the engine's figures, three latency histograms and the process's CPU, memory and fds.
        self.registry = CollectorRegistry()
        self.registry.register(EngineMetrics(self))
        ProcessCollector(registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=BUCKETS, registry=self.registry)

        self.ttft = histogram("mpinfer_time_to_first_token_seconds", "time to first token")
        self.tpot = histogram("mpinfer_time_per_output_token_seconds",
                              "time per output token after the first")  # fmt: skip
        self.latency = histogram("mpinfer_request_latency_seconds", "request latency")
        self.cancelled = 0
        self.closed_connections: dict[str, int] = {}  # reason -> count (guard.py's)
        self.dropped_streams = 0
        self.stall_logged = False
        self.lock = threading.Lock()
        self.dispatcher: Dispatcher | None = None

    def require_ready(self) -> None:
        """A 503 while loading or stopping: before a body is parsed, since parsing needs the
        tokenizer and the chat template that only a loaded engine brings."""
        if self.status != "ready":
            raise ApiError(503, f"the server is {self.status}", kind="unavailable")

    def attach(self, engine: Engine, chat: ChatTemplate) -> None:
        """The engine is built: the routes may use it."""
        self.engine, self.tokenizer, self.chat = engine, engine.tok, chat
        loaded = engine.loaded
        s, g = self.cfg.server, self.cfg.generation
        self.info = {
            "tp_size": loaded.tp.tp_size, "quant": self.cfg.quant.method,
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "max_batch_slots": engine.runner.slots, "cuda_graphs": engine.runner.use_graphs,
            "max_seq_len": s.max_seq_len, "max_queue": s.max_queue,
            "kv_block_size": engine.runner.block_size, "kv_cache_blocks": engine.runner.num_blocks,
            "prefix_caching": s.prefix_caching,
            "max_new_tokens_default": g.max_new_tokens,
            "generation_defaults": dataclasses.asdict(g), "chat_template": chat.origin,
        }  # fmt: skip

    def count(self, request, status: int) -> None:
        """One answered request, labelled by its route (every unmatched path is one label, so
        the metrics stay bounded whatever paths clients try)."""
        path = request.url.path
        route = path if path in self.paths else "unmatched"
        with self.lock:
            self.requests[(route, status)] += 1

    def observe(self, r: Result) -> None:
        with self.lock:
            if r.token_ids:
                self.ttft.observe(r.ttft_s)
                if len(r.token_ids) > 1:
                    self.tpot.observe((r.latency_s - r.ttft_s) / (len(r.token_ids) - 1))
            self.latency.observe(r.latency_s)


class Submission:
    """The jobs of one HTTP request, in the engine: tokenized, submitted together (or none of
    them), events tagged with the job's index in one queue."""

    @classmethod
    async def create(cls, state: State, jobs: tuple[Job, ...], *, status: int,
                     names: dict) -> Submission:  # fmt: skip
        """Check the request's size, tokenize its prompts on a worker thread (a megabyte of
        text takes the tokenizer a second: the event loop, /health and every other client go
        on meanwhile), then submit."""
        state.require_ready()
        most = state.cfg.server.max_jobs_per_request
        if len(jobs) > most:
            raise ApiError(status, f"this request asks for {len(jobs)} generations (prompts x n "
                           f"x best_of); at most {most} (server.max_jobs_per_request)")  # fmt: skip
        sub = cls(state, len(jobs))
        if any(isinstance(job.prompt, str) or len(job.prompt) > 4096 for job in jobs):
            await asyncio.to_thread(sub.submit, jobs, status, names)
        else:
            sub.submit(jobs, status, names)
        return sub

    def __init__(self, state: State, n_jobs: int):
        state.require_ready()
        self.state, self.queue = state, asyncio.Queue()
        if state.dispatcher is None:
            state.dispatcher = Dispatcher(asyncio.get_running_loop())
        self.prompt_ids: list[list[int]] = []
        self.done = [False] * n_jobs
        self.reqs = []
        self.dropped = False

    def submit(self, jobs: tuple[Job, ...], status: int, names: dict) -> None:
        """Tokenize and queue every job (on a worker thread for text prompts)."""
        state = self.state
        sinks = [state.dispatcher.sink(self.queue, i, self.drop) for i in range(len(jobs))]
        self.prompt_ids = tokenize(state, jobs, status, names)
        check_logprob_entries(state, jobs, self.prompt_ids, status, names)
        try:
            self.reqs = state.engine.submit_all(
                [(ids, job.params, sink) for ids, job, sink in zip(self.prompt_ids, jobs, sinks)]
            )
        except QueueFull as e:
            raise ApiError(429, str(e), kind="overloaded") from None
        except EngineFailed as e:
            raise ApiError(503, str(e), kind="unavailable") from None
        except ValueError as e:  # the engine's checks: length, token ids, parameters
            message = rename(str(e), names)
            raise ApiError(status, message, field=message.split(":", 1)[0]) from None

    def cancel(self) -> None:
        for req, done in zip(self.reqs, self.done):
            if not done:
                self.state.engine.cancel(req)

    def drop(self, waiting: int) -> None:
        """Past `server.max_stream_backlog` events waiting, the client is not reading its
        stream: cancel its generations, let go of what waits for it, and end the stream with
        an error (an unread stream holds a bounded part of rank 0's memory)."""
        if self.dropped or waiting <= self.state.cfg.server.max_stream_backlog:
            return
        self.dropped = True
        self.cancel()
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait((-1, Event("error", error="dropped")))
        with self.state.lock:
            self.state.dropped_streams += 1

    async def events(self, request):
        """(job index, token or done Event) until every job is done; a failed job raises
        ApiError 500; if the client goes away (or the consumer stops), the rest is cancelled."""
        left = len(self.reqs)
        checked = time.monotonic()
        try:
            while left:
                # Every half second, tokens flowing or not: has the client gone away?
                if time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                try:
                    i, ev = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    continue
                if self.dropped:
                    left = 0
                    most = self.state.cfg.server.max_stream_backlog
                    raise ApiError(408, f"the client read its stream too slowly: more than "
                                   f"{most} events waited for it (server.max_stream_backlog), "
                                   "its generations were cancelled",
                                   kind="slow_reader")  # fmt: skip
                if ev.kind == "error":
                    self.done[i] = True
                    raise ApiError(500, f"generation failed: {ev.error}", kind="generation")
                if ev.kind == "done":
                    self.done[i] = True
                    left -= 1
                    self.state.observe(ev.result)
                yield i, ev
        finally:
            if left:
                self.cancel()
                with self.state.lock:
                    self.state.cancelled += 1

    async def results(self, request) -> list[tuple[Result, list[Event]]] | None:
        """Every job's Result and token events, in job order; None if the client went away."""
        tokens: list[list[Event]] = [[] for _ in self.reqs]
        results: list[Result | None] = [None] * len(self.reqs)
        async for i, ev in self.events(request):
            if ev.kind == "token":
                tokens[i].append(ev)
            else:
                results[i] = ev.result
        if any(r is None for r in results):
            return None
        return list(zip(results, tokens))


def tokenize(state: State, jobs: tuple[Job, ...], status: int, names: dict) -> list[list[int]]:
    out = []
    for job in jobs:
        ids = job.prompt
        if isinstance(ids, str):
            check_text(ids, names.get("prompt", "prompt"), status)
            # encode_batch releases the GIL while it works (encode holds it: a megabyte kept
            # every other thread, the event loop included, waiting 2 s on this machine).
            ids = state.tokenizer.encode_batch([ids], add_special_tokens=False)[0].ids
        if job.truncate:
            ids = ids[: job.truncate] if job.keep_start else ids[-job.truncate :]
        out.append(list(ids))
    return out


def check_logprob_entries(state: State, jobs, prompt_ids, status: int, names: dict) -> None:
    """The log-probabilities one answer would carry (every prompt token and every generated one
    with their alternatives, when asked) against server.max_logprob_entries: a 127 KB prompt
    with echo and logprobs made a 66 MB answer."""
    entries = 0
    for job, ids in zip(jobs, prompt_ids):
        p = job.params
        if p.prompt_logprobs >= 0:
            entries += len(ids) * (1 + p.prompt_logprobs)
        if p.top_n:
            entries += p.max_new_tokens * (1 + p.top_n)
    most = state.cfg.server.max_logprob_entries
    if entries > most:
        key = names.get("prompt_logprobs", "logprobs")
        raise ApiError(status, f"{key}: this request asks for {entries} log-probabilities "
                       "(tokens x (1 + alternatives), prompt and answer, every choice); at most "
                       f"{most} (server.max_logprob_entries)", field=key)  # fmt: skip


def unix_time() -> int:
    return int(time.time())
