"""The text-generation-inference routes: POST /generate, /generate_stream (SSE) and / (TGI's
compat route; `stream` picks), with TGI's request fields and response shapes, so TGI's own
clients (`text_generation`, `huggingface_hub.InferenceClient`) work unchanged.

Fields (`parameters.*`): max_new_tokens, do_sample, temperature, top_k, top_p, typical_p,
repetition_penalty, frequency_penalty, stop, seed, truncate, details, return_full_text,
decoder_input_details (every prompt token's log-probability, and `top_n_tokens` alternatives),
top_n_tokens (alternatives of every generated token), best_of (several sampled sequences, the
one with the highest log-probability returned, the others in details.best_of_sequences).
What is not here: the HTTP app (routes.py), shared parsing (api.py).
"""

from __future__ import annotations

import dataclasses
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.sampling import MAX_TOP_N
from .api import ApiError, Fields, Job, Parsed, check_params, read_json, sampling_params, tgi_error
from .streams import State, Submission

STATUS = 422
FINISH = {"eos": "eos_token", "length": "length", "stop": "stop_sequence", "cancelled": "length"}
PARAMETERS = {
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "frequency_penalty", "stop", "seed", "details", "return_full_text",
    "truncate", "decoder_input_details", "best_of", "watermark", "top_n_tokens", "grammar",
    "adapter_id",
}  # fmt: skip
MAX_BEST_OF = 8


def parse_tgi(body: bytes, state: State, *, stream: bool | None) -> Parsed:
    data = read_json(body, STATUS)
    top = Fields(data, STATUS)
    top.reject_unknown({"inputs", "parameters", "stream"})
    prompt = top.get("inputs", "str")
    if not prompt:
        top.fail("inputs", "must be a non-empty string")
    asked_stream = top.get("stream", "bool", False)  # checked on every route
    raw = top.get("parameters", "object", {})
    f = Fields(raw, STATUS, "parameters.")
    f.reject_unknown(PARAMETERS)
    f.reject_set("watermark", "is not supported", (None, False))
    for key in ("grammar", "adapter_id"):
        f.reject_set(key, "is not supported")
    truncate = f.ranged("truncate", "int", 1, 2**31)
    top_n = f.ranged("top_n_tokens", "int", 0, MAX_TOP_N, 0)
    best_of = f.ranged("best_of", "int", 1, MAX_BEST_OF, 1)
    options = {key: bool(f.get(key, "bool", False)) for key in
               ("details", "return_full_text", "decoder_input_details")}  # fmt: skip
    params = sampling_params(f, state.cfg.generation, max_new_key="max_new_tokens",
                             max_new=f.ranged("max_new_tokens", "int", 1, 2**31),
                             sample_default=False, names={})  # fmt: skip
    params = dataclasses.replace(
        params, top_n=top_n, prompt_logprobs=top_n if options["decoder_input_details"] else -1
    )
    check_params(params, f, {"top_n": "top_n_tokens"})
    stream = asked_stream if stream is None else stream
    if best_of > 1:
        if params.greedy:
            f.fail("best_of", "best_of > 1 needs sampling (do_sample or a temperature)")
        if stream:
            f.fail("best_of", "best_of > 1 cannot be streamed")
    jobs = tuple(Job(prompt, _nth_seed(params, i), truncate) for i in range(best_of))
    return Parsed(jobs, stream=stream, options={**options, "prompt": prompt, "top_n": top_n})


def _nth_seed(params, i: int):
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % 2**64)


def token_json(state: State, token_id: int, text: str, logprob) -> dict:
    eos = state.engine.loaded.shape.eos_token_id
    return {"id": token_id, "text": text, "logprob": logprob, "special": token_id == eos}


def top_tokens(state: State, top) -> list[dict]:
    return [token_json(state, i, state.tokenizer.decode([i]), lp) for i, lp in top]


def details(state: State, parsed: Parsed, ids, result, tokens) -> dict:
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
            parsed = parse_tgi(await request.body(), state, stream=stream)
            sub = await Submission.create(
                state, parsed.jobs, status=STATUS, names={"prompt": "inputs"}
            )
        except ApiError as e:
            state.count(request, e.status)
            return JSONResponse(tgi_error(e), status_code=e.status)
        state.count(request, 200)
        if parsed.stream:
            return StreamingResponse(stream_events(request, sub, parsed),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            done = await sub.results(request)
        except ApiError as e:
            return JSONResponse(tgi_error(e), status_code=e.status)
        if done is None:  # the client went away
            return JSONResponse({}, status_code=499)
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
        return JSONResponse([out] if request.url.path == "/" else out)

    async def stream_events(request: Request, sub: Submission, parsed: Parsed):
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
        except ApiError as e:
            yield sse(tgi_error(e))

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
