"""The HTTP server on rank 0: TGI and OpenAI routes over the engine, plus health and metrics.

Routes: POST /generate, /generate_stream (SSE), / (TGI's compat route: `stream` picks one),
POST /v1/completions (with `stream`), GET /v1/models, /info, /health, /metrics (Prometheus).
Uvicorn runs on a thread of rank 0 and starts before the model loads (so /health answers 503
while loading); the engine runs on rank 0's main thread. Requests are parsed and checked
(api.py) before they are queued; events come back from the engine thread through
`call_soon_threadsafe`, once per engine step for all of its events (one wake-up of the event
loop, not one per token). A client that goes away cancels its request. What is not here:
request parsing rules (api.py), scheduling (engine.py), process start-up and signals (serve.py).
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
import uuid
from collections import defaultdict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from . import __version__
from .api import ApiError, Parsed, openai_error, parse_openai, parse_tgi, tgi_error
from .engine import Engine
from .request import EngineFailed, Event, QueueFull

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Histogram:
    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum, self.n = 0.0, 0

    def observe(self, v: float) -> None:
        self.counts[next((i for i, b in enumerate(BUCKETS) if v <= b), len(BUCKETS))] += 1
        self.sum += v
        self.n += 1

    def render(self, name: str) -> list[str]:
        lines, total = [f"# TYPE {name} histogram"], 0
        for b, c in zip(BUCKETS, self.counts):
            total += c
            lines.append(f'{name}_bucket{{le="{b}"}} {total}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        return lines + [f"{name}_sum {self.sum}", f"{name}_count {self.n}"]


class Dispatcher:
    """Engine events onto the event loop: the engine thread appends (queue, event) pairs, and
    the first append after a flush schedules one flush on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False

    def sink(self, queue: asyncio.Queue):
        def put(ev: Event) -> None:
            with self.lock:
                self.items.append((queue, ev))
                if self.scheduled:
                    return
                self.scheduled = True
            self.loop.call_soon_threadsafe(self.flush)

        return put

    def flush(self) -> None:
        with self.lock:
            items, self.items = self.items, collections.deque()
            self.scheduled = False
        for queue, ev in items:
            queue.put_nowait(ev)


class State:
    """What the routes share: the engine once loaded, its status, and the metrics."""

    def __init__(self, cfg, *, model_name: str):
        self.cfg, self.model_name = cfg, model_name
        self.status = "loading"  # loading | ready | stopping | failed
        self.engine: Engine | None = None
        self.tokenizer = None
        self.info: dict = {}
        self.requests = defaultdict(int)  # (route, status) -> count
        self.ttft, self.latency = Histogram(), Histogram()
        self.cancelled = 0
        self.lock = threading.Lock()
        self.dispatcher: Dispatcher | None = None

    def attach(self, engine: Engine) -> None:
        """The engine is built: the routes may use it."""
        self.engine, self.tokenizer = engine, engine.tok
        loaded = engine.loaded
        s, g = self.cfg.server, self.cfg.generation
        self.info = {
            "tp_size": loaded.tp.tp_size, "quant": self.cfg.quant.method,
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "max_batch_slots": engine.runner.slots, "cuda_graphs": engine.runner.use_graphs,
            "max_seq_len": s.max_seq_len, "max_queue": s.max_queue,
            "max_new_tokens_default": g.max_new_tokens,
        }  # fmt: skip

    def count(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[(route, status)] += 1


FINISH_TGI = {"eos": "eos_token", "length": "length", "stop": "stop_sequence"}
FINISH_OPENAI = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def build_app(state: State) -> FastAPI:
    app = FastAPI(title="mpinfer", version=__version__)
    cfg = state.cfg.server

    @app.middleware("http")
    async def guard(request: Request, call_next):
        openai = request.url.path.startswith("/v1/")
        if cfg.api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {cfg.api_key}":
                err = ApiError(401, "missing or wrong bearer token", field="authorization",
                               kind="auth")  # fmt: skip
                return error_response(request, err)
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > cfg.max_body_bytes:
            err = ApiError(413, f"request body of {size} bytes is over the {cfg.max_body_bytes} "
                           "byte limit", kind="payload_too_large")  # fmt: skip
            return error_response(request, err, openai)
        return await call_next(request)

    def error_response(request, e: ApiError, openai: bool | None = None):
        if openai is None:
            openai = request.url.path.startswith("/v1/")
        state.count(request.url.path, e.status)
        body = openai_error(e) if openai else tgi_error(e)
        return JSONResponse(body, status_code=e.status)

    async def read_body(request: Request, status: int) -> bytes:
        body = await request.body()
        if len(body) > cfg.max_body_bytes:
            raise ApiError(413, f"request body over the {cfg.max_body_bytes} byte limit")
        return body

    def submit(parsed: Parsed, status: int) -> tuple[object, asyncio.Queue, list[int]]:
        if state.status != "ready":
            raise ApiError(503, f"the server is {state.status}", kind="unavailable")
        ids = state.tokenizer.encode(parsed.prompt, add_special_tokens=False).ids
        if parsed.truncate:
            ids = ids[-parsed.truncate :]
        queue: asyncio.Queue = asyncio.Queue()
        if state.dispatcher is None:
            state.dispatcher = Dispatcher(asyncio.get_running_loop())
        try:
            req = state.engine.submit(ids, parsed.params, state.dispatcher.sink(queue))
        except QueueFull as e:
            raise ApiError(429, str(e), kind="overloaded") from None
        except EngineFailed as e:
            raise ApiError(503, str(e), kind="unavailable") from None
        except ValueError as e:  # the engine's length checks name the field
            raise ApiError(status, str(e), field=str(e).split(":", 1)[0]) from None
        return req, queue, ids

    async def events(request: Request, req, queue: asyncio.Queue):
        """The request's engine events; cancels it if the client goes away or the task ends."""
        done = False
        try:
            while True:
                try:
                    ev: Event = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if ev.kind == "error":
                    done = True  # the engine has finished with it
                    raise ApiError(500, f"generation failed: {ev.error}", kind="generation")
                yield ev
                if ev.kind == "done":
                    done = True
                    r = ev.result
                    if r.token_ids:
                        state.ttft.observe(r.ttft_s)
                    state.latency.observe(r.latency_s)
                    return
        finally:
            if not done:
                state.engine.cancel(req)
                with state.lock:
                    state.cancelled += 1

    # -- TGI -------------------------------------------------------------------------------------
    async def tgi(request: Request, stream: bool | None):
        try:
            body = await read_body(request, 422)
            parsed = parse_tgi(body, default_max_new=state.cfg.generation.max_new_tokens,
                               stream=stream)  # fmt: skip
            req, queue, ids = submit(parsed, 422)
        except ApiError as e:
            return error_response(request, e, False)
        if parsed.stream:
            state.count(request.url.path, 200)
            return StreamingResponse(tgi_stream(request, req, queue, parsed, ids),
                                     media_type="text/event-stream")  # fmt: skip
        tokens, result = [], None
        try:
            async for ev in events(request, req, queue):
                if ev.kind == "token":
                    tokens.append(ev)
                else:
                    result = ev.result
        except ApiError as e:
            return error_response(request, e, False)
        if result is None:  # the client went away
            return JSONResponse({}, status_code=499)
        state.count(request.url.path, 200)
        out = tgi_response(parsed, ids, tokens, result)
        return JSONResponse([out] if request.url.path == "/" else out)

    def token_json(ev: Event) -> dict:
        eos = state.engine.loaded.shape.eos_token_id
        return {"id": ev.token_id, "text": ev.text, "logprob": ev.logprob,
                "special": ev.token_id == eos}  # fmt: skip

    def tgi_response(parsed: Parsed, ids, tokens, result) -> dict:
        text = (parsed.prompt if parsed.return_full_text else "") + result.text
        out = {"generated_text": text}
        if parsed.details or parsed.decoder_input_details:
            out["details"] = {
                "finish_reason": FINISH_TGI.get(result.finish_reason, result.finish_reason),
                "generated_tokens": len(result.token_ids),
                "seed": result.seed if not parsed.params.greedy else None,
                "prefill": [
                    {"id": i, "text": state.tokenizer.decode([i]), "logprob": None} for i in ids
                ]
                if parsed.decoder_input_details
                else [],  # fmt: skip
                "tokens": [token_json(t) for t in tokens],
            }
        return out

    async def tgi_stream(request, req, queue, parsed: Parsed, ids):
        held = None  # one event behind, so the last token carries generated_text and details
        try:
            async for ev in events(request, req, queue):
                if ev.kind == "token":
                    if held is not None:
                        yield sse({"token": token_json(held), "generated_text": None,
                                   "details": None})  # fmt: skip
                    held = ev
                    continue
                r = ev.result
                last = held or Event("token", token_id=-1, text="")
                text = (parsed.prompt if parsed.return_full_text else "") + r.text
                details = {
                    "finish_reason": FINISH_TGI.get(r.finish_reason, r.finish_reason),
                    "generated_tokens": len(r.token_ids),
                    "seed": r.seed if not parsed.params.greedy else None,
                }
                yield sse({"token": token_json(last), "generated_text": text, "details": details})
        except ApiError as e:
            yield sse(tgi_error(e))

    @app.post("/generate")
    async def generate(request: Request):
        return await tgi(request, False)

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        return await tgi(request, True)

    @app.post("/")
    async def compat(request: Request):
        return await tgi(request, None)

    # -- OpenAI ----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await read_body(request, 400)
            parsed = parse_openai(body)
            req, queue, ids = submit(parsed, 400)
        except ApiError as e:
            return error_response(request, e, True)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": state.model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": None,
                                 "finish_reason": finish}]}  # fmt: skip

        if parsed.stream:
            state.count(request.url.path, 200)

            async def gen():
                try:
                    if parsed.echo:
                        yield sse(chunk(parsed.prompt, None))
                    async for ev in events(request, req, queue):
                        if ev.kind == "token" and ev.text:
                            yield sse(chunk(ev.text, None))
                        elif ev.kind == "done":
                            reason = ev.result.finish_reason
                            yield sse(chunk(ev.text, FINISH_OPENAI.get(reason, reason)))
                    yield "data: [DONE]\n\n"
                except ApiError as e:
                    yield sse(openai_error(e))

            return StreamingResponse(gen(), media_type="text/event-stream")
        result = None
        try:
            async for ev in events(request, req, queue):
                if ev.kind == "done":
                    result = ev.result
        except ApiError as e:
            return error_response(request, e, True)
        if result is None:
            return JSONResponse({}, status_code=499)
        state.count(request.url.path, 200)
        out = chunk((parsed.prompt if parsed.echo else "") + result.text,
                    FINISH_OPENAI.get(result.finish_reason, result.finish_reason))  # fmt: skip
        n = len(result.token_ids)
        out["usage"] = {"prompt_tokens": len(ids), "completion_tokens": n,
                        "total_tokens": len(ids) + n}  # fmt: skip
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "created": 0, "owned_by": "mpinfer"}]}  # fmt: skip

    # -- operations ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        code = 200 if state.status == "ready" else 503
        return JSONResponse({"status": state.status}, status_code=code)

    @app.get("/info")
    async def info():
        return {"model_id": state.model_name, "version": __version__, "status": state.status,
                **state.info}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        e = state.engine
        lines = [
            "# TYPE mpinfer_queue_depth gauge", f"mpinfer_queue_depth {e.queue_depth if e else 0}",
            "# TYPE mpinfer_running_slots gauge",
            f"mpinfer_running_slots {e.running_slots if e else 0}",
            "# TYPE mpinfer_generated_tokens_total counter",
            f"mpinfer_generated_tokens_total {e.generated_tokens if e else 0}",
            "# TYPE mpinfer_engine_steps_total counter",
            f"mpinfer_engine_steps_total {e.steps if e else 0}",
            "# TYPE mpinfer_cancelled_requests_total counter",
            f"mpinfer_cancelled_requests_total {state.cancelled}",
            "# TYPE mpinfer_requests_total counter",
        ]  # fmt: skip
        with state.lock:
            for (route, status), n in sorted(state.requests.items()):
                lines.append(f'mpinfer_requests_total{{route="{route}",status="{status}"}} {n}')
            lines += state.ttft.render("mpinfer_time_to_first_token_seconds")
            lines += state.latency.render("mpinfer_request_latency_seconds")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
