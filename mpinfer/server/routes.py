"""The HTTP app on rank 0: the TGI routes (tgi.py) and the OpenAI routes (oairoutes.py) over the
engine, plus operations: GET /health, /info, /metrics (Prometheus), /openapi.json; and vLLM's
POST /tokenize, /detokenize and GET /tokenizer_info, so tools that tokenize on the server
(lm-evaluation-harness) need no tokenizer of their own; GET /load (vLLM's server load) and
GET|POST /ping (SageMaker's health check).

Before any route: guard.py's checks (the bearer token, body and header limits, JSON content
type, the Host header). Metrics count requests by route template, unmatched paths as one label.
Every error is JSON, in the route family's shape: a 4xx naming the field for bad input, 404/405
for a wrong path or method, and for anything unexpected a 500 for that request alone (logged),
never a crashed server. What is not here: request parsing (api.py, oai.py), the engine bridge
(streams.py), process start-up and signals (serve.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from . import oairoutes, tgi
from .api import ApiError, Body, json_off_loop, openai_error, read_json, tgi_error, validate
from .guard import BodyTooLarge, Guard, resolve_api_key
from .oai import Message, OpenAIError, fail, message_list, render_chat
from .openapi import describe
from .streams import State

log = logging.getLogger("mpinfer")
WORKER_THREADS = 32
OPENAI_SHAPED = ("/tokenize", "/detokenize", "/tokenizer_info", "/invocations")  # vLLM's


def error_response(request: Request, e: ApiError, state: State | None = None) -> JSONResponse:
    openai = request.url.path.startswith("/v1/") or request.url.path in OPENAI_SHAPED
    if state is not None:
        state.count(request, e.status)
    return JSONResponse(openai_error(e) if openai else tgi_error(e), status_code=e.status)


def build_app(state: State) -> FastAPI:
    # Swagger UI and ReDoc load their scripts from a CDN: a blank page offline, and a page
    # that runs third-party code; on only with server.docs (/openapi.json is always there).
    docs = state.cfg.server.docs

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # Parsing, chat templates, tokenizing and large answers run on worker threads: enough
        # of them that a few slow requests do not queue the rest (asyncio's default: cores + 4).
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="http-work")
        )
        yield

    app = FastAPI(title="mpinfer", version=__version__, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, lifespan=lifespan,
                  description="BLOOM-class models with int8 weights and tensor parallelism: "
                  "TGI and OpenAI-compatible routes.")  # fmt: skip
    cfg = state.cfg.server

    resolve_api_key(cfg.api_key)  # a missing variable or file is a start-up error, not a 500
    app.add_middleware(Guard, cfg=cfg, reject=lambda request, e: error_response(request, e, state))

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge):
        return error_response(request, ApiError(413, str(exc), kind="payload_too_large"), state)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(request, ApiError(exc.status_code, str(exc.detail),
                                                kind="not_found"), state)  # fmt: skip

    @app.exception_handler(ClientDisconnect)
    async def went_away(request: Request, exc: ClientDisconnect):
        # An upload aborted mid-body: nobody to answer; counted as 499, a line at debug level.
        log.debug("%s: the client left before its body arrived", request.url.path)
        state.count(request, 499)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception):
        log.exception("request %s failed", request.url.path)
        return error_response(request, ApiError(500, f"internal error: {type(exc).__name__}: "
                                                f"{exc}", kind="internal"), state)  # fmt: skip

    app.include_router(tgi.make_router(state))
    app.include_router(oairoutes.make_router(state))

    def spec():
        vocab = state.engine.loaded.shape.vocab_size if state.engine else None
        if app.openapi_schema is None or (vocab and not app.openapi_schema.get("x-loaded")):
            app.openapi_schema = None  # FastAPI caches it: rebuild once the model is in
            app.openapi_schema = describe(FastAPI.openapi(app), TOKENIZER_BODIES,
                                          max_seq_len=cfg.max_seq_len,
                                          vocab_size=vocab)  # fmt: skip
            app.openapi_schema["x-loaded"] = bool(vocab)
        return app.openapi_schema

    app.openapi = spec

    # -- operations ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        status = state.status
        stalled = state.engine.stalled_for() if state.engine and status == "ready" else 0.0
        if stalled > cfg.stall_timeout_s:
            status = "stalled"
            if not state.stall_logged:
                log.error("no engine step completed for %.0f s with requests waiting (a rank "
                          "stopped or a collective hangs): /health answers 503",
                          stalled)  # fmt: skip
            state.stall_logged = True
        else:
            state.stall_logged = False
        code = 200 if status == "ready" else 503
        return JSONResponse({"status": status}, status_code=code)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's health check, as vLLM serves it: /health's answer."""
        return await health()

    @app.get("/load")
    async def load():
        """vLLM's server-load route (what a load balancer polls): the sequences waiting or
        running in the engine (a request with n: 4 counts 4; vLLM counts HTTP requests)."""
        e = state.engine
        return {"server_load": (e.queue_depth + e.running_slots) if e else 0}

    @app.get("/info")
    async def info():
        return {"model_id": state.model_name, "version": __version__, "status": state.status,
                **state.info}  # fmt: skip

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        if state.tokenizer is None:
            return error_response(request, ApiError(503, "the model is loading",
                                                    kind="unavailable"))  # fmt: skip
        shape = state.engine.loaded.shape
        decode = state.tokenizer.decode
        return {"eos_token": decode([shape.eos_token_id], skip_special_tokens=False),
                "bos_token": decode([shape.bos_token_id], skip_special_tokens=False),
                "pad_token": decode([shape.pad_token_id], skip_special_tokens=False),
                "eos_token_id": shape.eos_token_id, "model_max_length": cfg.max_seq_len,
                "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip

    def tokenizer_request(model, body: bytes):
        """The body of a tokenizer route, once the tokenizer is loaded (a 503 before)."""
        if state.tokenizer is None:
            raise ApiError(503, "the model is loading", kind="unavailable")
        return validate(model, read_json(body, 400), 400)

    @app.post("/tokenize", openapi_extra={"x-mpinfer-body": "TokenizeRequest"})
    async def tokenize(request: Request):
        body = await request.body()
        try:  # a megabyte of text or a chat template: on a worker thread, not the event loop
            built = await json_off_loop(lambda: tokenized(body))  # built and written there
            return Response(built, media_type="application/json")
        except ApiError as e:
            return error_response(request, e, state)

    def tokenized(body: bytes) -> dict:
        r = tokenizer_request(TokenizeRequest, body)
        if r.messages is not None:  # vLLM's chat form: the rendered prompt's tokens
            if r.prompt is not None:
                fail("messages", "give prompt or messages, not both")
            text = render_chat(state.chat, message_list(r.messages),
                               add_generation_prompt=r.add_generation_prompt,
                               continue_final_message=r.continue_final_message)  # fmt: skip
        else:
            text = r.prompt or ""
        ids = state.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        out = {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_seq_len}
        if r.return_token_strs:
            out["token_strs"] = [state.tokenizer.decode([i], skip_special_tokens=False)
                                 for i in ids]  # fmt: skip
        return out

    @app.post("/detokenize", openapi_extra={"x-mpinfer-body": "DetokenizeRequest"})
    async def detokenize(request: Request):
        try:
            r = tokenizer_request(DetokenizeRequest, await request.body())
            vocab = state.engine.loaded.shape.vocab_size
            if any(t >= vocab for t in r.tokens):
                fail("tokens", f"expected token ids in [0, {vocab})")
            return {"prompt": state.tokenizer.decode(r.tokens)}
        except ApiError as e:
            return error_response(request, e, state)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    state.paths = set(route_paths(app.routes))
    return app


class TokenizeRequest(Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    prompt: str | None = None
    messages: list[Message] | None = None
    model: str | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(Body):
    tokens: list[Annotated[int, Field(ge=0)]] = []
    model: str | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


TOKENIZER_BODIES = {
    "TokenizeRequest": (TokenizeRequest, TokenizeResponse, OpenAIError),
    "DetokenizeRequest": (DetokenizeRequest, DetokenizeResponse, OpenAIError),
}


def route_paths(routes):
    """Every path the app serves, included routers' too (the metrics' route labels)."""
    for r in routes:
        if isinstance(getattr(r, "path", None), str):
            yield r.path
        inner = getattr(r, "original_router", None)  # FastAPI's include_router, unprefixed here
        if inner is not None:
            yield from route_paths(inner.routes)
