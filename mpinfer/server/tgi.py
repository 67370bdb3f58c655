"""The text-generation-inference routes: POST /generate, /generate_stream (SSE) and / (TGI's
compat route; `stream` picks), with TGI's request fields and response shapes, so TGI's own
clients (`text_generation`, `huggingface_hub.InferenceClient`) work unchanged.

Fields (`parameters.*`): max_new_tokens, do_sample, temperature, top_k, top_p, typical_p,
repetition_penalty, frequency_penalty, stop, seed, truncate, details, return_full_text,
decoder_input_details (every prompt token's log-probability, and `top_n_tokens` alternatives),
top_n_tokens (alternatives of every generated token), best_of (several sampled sequences, the
one with the highest log-probability returned, the others in details.best_of_sequences).
The request, response and error bodies are pydantic models here (TgiRequest, TgiResponse,
TgiError): they parse, validate and describe the routes in /openapi.json. What is not here: the
HTTP app (routes.py), shared parsing (api.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from ..engine.sampling import MAX_TOP_N
from . import api
from .streams import State, Submission

STATUS = 422
FINISH = {"eos": "eos_token", "length": "length", "stop": "stop_sequence", "cancelled": "length"}
MAX_BEST_OF = 8


class TgiParameters(api.SamplingFields):
    max_new_tokens: api.Count | None = None
    do_sample: bool | None = None
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False  # every prompt token's log-probability
    truncate: api.Count | None = None  # keep only the prompt's last tokens
    top_n_tokens: int = Field(0, ge=0, le=MAX_TOP_N)
    best_of: int = Field(1, ge=1, le=MAX_BEST_OF)
    watermark: Literal[False] = False  # accepted for TGI's clients, which send false
    grammar: None = Field(None, description="not supported")
    adapter_id: None = Field(None, description="not supported")


class TgiRequest(api.Body):
    inputs: str = Field(min_length=1)
    parameters: TgiParameters = TgiParameters()
    stream: bool = False


class TgiResponse(BaseModel):
    generated_text: str
    details: dict | None = Field(None, description="finish_reason, generated_tokens, seed, "
                                 "prefill, tokens, top_tokens, best_of_sequences")  # fmt: skip


class TgiError(BaseModel):
    error: str
    error_type: str
    field: str = ""


def parse_tgi(body: bytes, state: State, *, stream: bool | None) -> api.Parsed:
    data = api.read_json(body, STATUS)
    r = api.validate(TgiRequest, data, STATUS)
    f = r.parameters
    options = {"details": f.details, "return_full_text": f.return_full_text,
               "decoder_input_details": f.decoder_input_details}  # fmt: skip
    params = api.sampling_params(f, state.cfg.generation, max_new_key="max_new_tokens",
                             max_new=f.max_new_tokens, sample_default=False, names={},
                             status=STATUS, prefix="parameters.")  # fmt: skip
    params = dataclasses.replace(params, top_n=f.top_n_tokens,
                                 prompt_logprobs=f.top_n_tokens if f.decoder_input_details
                                 else -1)  # fmt: skip
    api.check_params(params, STATUS, "parameters.", {"top_n": "top_n_tokens"})
    stream = r.stream if stream is None else stream
    if f.best_of > 1:
        if params.greedy:
            fail("best_of", "best_of > 1 needs sampling (do_sample or a temperature)")
        if stream:
            fail("best_of", "best_of > 1 cannot be streamed")
    jobs = tuple(api.Job(r.inputs, api.nth_seed(params, i), f.truncate) for i in range(f.best_of))
    return api.Parsed(jobs, stream=stream, options={**options, "prompt": r.inputs,
                                                "top_n": f.top_n_tokens})  # fmt: skip


def fail(key: str, message: str):
    raise api.ApiError(STATUS, f"parameters.{key}: {message}", field=f"parameters.{key}")


def token_json(state: State, token_id: int, text: str, logprob) -> dict:
    eos = state.engine.loaded.shape.eos_token_id
    return {"id": token_id, "text": text, "logprob": logprob, "special": token_id == eos}


def top_tokens(state: State, top) -> list[dict]:
    return [token_json(state, i, state.tokenizer.decode([i]), lp) for i, lp in top]


def details(state: State, parsed: api.Parsed, ids, result, tokens) -> dict:
    out = {
        "finish_reason": FINISH.get(result.finish_reason, result.finish_reason),
        "generated_tokens": len(result.token_ids),
        "seed": None if parsed.jobs[0].params.greedy else result.seed,
        "prefill": [],
        "tokens": [token_json(state, t.token_id, t.text, t.logprob) for t in tokens],
    }
    if parsed.options["decoder_input_details"]:
        out["prefill"] = [token_json(state, i, state.tokenizer.decode([i]), lp)
                          for i, lp in zip(ids, result.prompt_logprobs)]  # fmt: skip
    if parsed.options["top_n"]:
        out["top_tokens"] = [top_tokens(state, t.top) for t in tokens]
    return out


def make_router(state: State) -> APIRouter:
    router = APIRouter()

    async def handle(request: Request, stream: bool | None):
        try:
            state.require_ready()
            parsed = await asyncio.to_thread(parse_tgi, await request.body(), state,
                                             stream=stream)  # fmt: skip
            sub = await Submission.create(
                state,
                parsed.jobs,
                status=STATUS,
                names={"prompt": "inputs", "prompt_logprobs": "parameters.decoder_input_details"},
            )
        except api.ApiError as e:
            state.count(request, e.status)
            return JSONResponse(api.tgi_error(e), status_code=e.status)
        state.count(request, 200)
        if parsed.stream:
            return StreamingResponse(stream_events(request, sub, parsed),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            done = await sub.results(request)
        except api.ApiError as e:
            return JSONResponse(api.tgi_error(e), status_code=e.status)
        if done is None:  # the client went away
            return JSONResponse({}, status_code=499)
        built = await api.json_off_loop(lambda: answer(parsed, sub, done, request.url.path))
        return Response(built, media_type="application/json")

    def answer(parsed: api.Parsed, sub: Submission, done, path: str):
        prefix = parsed.options["prompt"] if parsed.options["return_full_text"] else ""
        ids = sub.prompt_ids[0]
        # best_of: the sequence with the highest log-probability, the others beside it.
        order = sorted(range(len(done)), key=lambda i: -sum(done[i][0].logprobs))
        result, tokens = done[order[0]]
        out = {"generated_text": prefix + result.text}
        if parsed.options["details"] or parsed.options["decoder_input_details"]:
            out["details"] = details(state, parsed, ids, result, tokens)
            if len(done) > 1:
                out["details"]["best_of_sequences"] = [
                    {"generated_text": prefix + done[i][0].text,
                     **details(state, parsed, ids, *done[i])} for i in order[1:]
                ]  # fmt: skip
        return [out] if path == "/" else out

    async def stream_events(request: Request, sub: Submission, parsed: api.Parsed):
        held, index = None, 0  # one event behind: the last token carries generated_text
        prefix = parsed.options["prompt"] if parsed.options["return_full_text"] else ""
        try:
            async for _, ev in sub.events(request):
                if ev.kind == "token":
                    if held is not None:
                        yield sse(event_json(held, index, None, None))
                        index += 1
                    held = ev
                    continue
                r = ev.result
                last = held or ev  # a request cancelled before its first token
                final = {"finish_reason": FINISH.get(r.finish_reason, r.finish_reason),
                         "generated_tokens": len(r.token_ids),
                         "seed": None if parsed.jobs[0].params.greedy else r.seed}  # fmt: skip
                yield sse(event_json(last, index, prefix + r.text, final))
        except api.ApiError as e:
            yield sse(api.tgi_error(e))

    def event_json(ev, index: int, text, final) -> dict:
        out = {"index": index, "token": token_json(state, ev.token_id, ev.text, ev.logprob),
               "generated_text": text, "details": final}  # fmt: skip
        out["top_tokens"] = top_tokens(state, ev.top) if ev.top else None
        return out

    @router.post("/generate", openapi_extra={"x-mpinfer-body": "TgiRequest"})
    async def generate(request: Request):
        return await handle(request, False)

    @router.post("/generate_stream", openapi_extra={"x-mpinfer-body": "TgiRequest"})
    async def generate_stream(request: Request):
        return await handle(request, True)

    @router.post("/", openapi_extra={"x-mpinfer-body": "TgiRequest"})
    async def compat(request: Request):
        return await handle(request, None)

    return router


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
