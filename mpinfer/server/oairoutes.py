"""The OpenAI-compatible routes: POST /v1/completions and /v1/chat/completions (plain JSON or SSE
chunks, OpenAI's shapes: choices by index, `usage`, a final usage chunk with
`stream_options.include_usage`, usage in every chunk with vLLM's `continuous_usage_stats`), and
GET /v1/models. Log-probabilities: completions return OpenAI's legacy object (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob} holding the top k and the chosen token,
`text_offset`), over the prompt too with `echo` (its first entry null); chat returns
`logprobs.content` entries with `top_logprobs`. What is not here: request parsing (oai.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from .api import ApiError, Parsed, finite, json_off_loop, openai_error, read_json
from .oai import NAMES, STATUS, parse_batch_chat, parse_chat, parse_completions
from .streams import State, Submission, unix_time

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


def make_router(state: State) -> APIRouter:
    router = APIRouter()

    def text_of(token_id: int) -> str:
        # Every token's own text, special tokens included (<s>, </s>, <unk> are tokens too).
        return state.tokenizer.decode([token_id], skip_special_tokens=False)

    def vllm_prompt_logprobs(ids, r) -> list | None:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank,
        decoded_token}} with the prompt token (its rank in the whole vocabulary) and its
        alternatives."""
        out = [None]
        for j in range(1, len(ids)):
            lp, top = r.prompt_logprobs[j], r.prompt_top_logprobs[j] or []
            entry = {str(ids[j]): {"logprob": finite(lp), "rank": r.prompt_ranks[j],
                                   "decoded_token": text_of(ids[j])}}  # fmt: skip
            for k, (t, v) in enumerate(top):
                entry.setdefault(str(t), {"logprob": finite(v), "rank": k + 1,
                                          "decoded_token": text_of(t)})  # fmt: skip
            out.append(entry)
        return out

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip

    def namer(o: dict):
        """How log-probability entries name a token: its text, or with vLLM's
        return_tokens_as_token_ids `token_id:N` (every token identifiable, text or not)."""
        if o.get("return_tokens_as_token_ids"):
            return lambda token_id: f"token_id:{token_id}"
        return text_of

    def legacy_logprobs(entries, offset: int, name=text_of) -> dict:
        """entries: (token id, logprob | None, top [(id, lp)] | None) -> OpenAI's object;
        `text_offset` counts characters of the text, however the tokens are named."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp, top in entries:
            out["tokens"].append(name(token_id))
            out["token_logprobs"].append(finite(lp))
            alternatives = None
            if lp is not None:
                alternatives = {name(i): finite(v) for i, v in (top or [])}
                alternatives[name(token_id)] = finite(lp)  # the chosen token is always there
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(offset)
            offset += len(text_of(token_id))
        return out

    def chat_logprob(token_id: int, lp: float, top, name=text_of) -> dict:
        """One token of chat's logprobs.content; `bytes` are always the token's text."""
        return {"token": name(token_id), "logprob": finite(lp),
                "bytes": list(text_of(token_id).encode()),
                "top_logprobs": [{"token": name(i), "logprob": finite(v),
                                  "bytes": list(text_of(i).encode())} for i, v in top]}  # fmt: skip

    async def start(request: Request, parse):
        state.require_ready()
        # Parsing renders chat templates and reads up to a megabyte of JSON: a worker's job.
        parsed = await asyncio.to_thread(parse, await request.body(), state)
        names = {**NAMES, "max_new_tokens": parsed.options.get("max_key", "max_tokens")}
        return parsed, await Submission.create(state, parsed.jobs, status=STATUS, names=names)

    def error(request: Request, e: ApiError) -> JSONResponse:
        state.count(request, e.status)
        return JSONResponse(openai_error(e), status_code=e.status)

    # -- completions -----------------------------------------------------------------------------
    async def respond(request: Request, parse, prefix: str, streamer, body):
        """Parse, submit, then stream the events with `streamer` or answer with `body` of the
        finished results: the request path both OpenAI routes share."""
        try:
            parsed, sub = await start(request, parse)
        except ApiError as e:
            return error(request, e)
        cid, created = f"{prefix}-{uuid.uuid4().hex[:24]}", unix_time()
        if parsed.stream:  # a stream's status is sent now: 200, whatever comes later
            state.count(request, 200)
            return StreamingResponse(streamer(request, sub, parsed, cid, created),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            done = await sub.results(request)
        except ApiError as e:  # a late failure: counted once, by its own status
            return error(request, e)
        if done is None:
            state.count(request, 499)
            return JSONResponse({}, status_code=499)
        state.count(request, 200)
        return Response(await json_off_loop(lambda: body(parsed, sub, done, cid, created)),
                        media_type="application/json")  # fmt: skip

    @router.post("/v1/completions", openapi_extra={"x-mpinfer-body": "CompletionRequest"})
    async def completions(request: Request):
        return await respond(request, parse_completions, "cmpl", stream_completions,
                             completion_body)  # fmt: skip

    def completion_body(parsed: Parsed, sub: Submission, done, cid: str, created: int) -> dict:
        o = parsed.options
        n, best_of, choices = o["n"], o["best_of"], []
        for p, ids in enumerate(sub.prompt_ids[::best_of]):
            group = done[p * best_of : (p + 1) * best_of]
            # best_of: the n with the highest log-probability per token (as OpenAI picks).
            group.sort(key=lambda d: -sum(d[0].logprobs) / max(len(d[0].logprobs), 1))
            for j, (r, _) in enumerate(group[:n]):
                prompt_text = echo_text(ids) if o["echo"] else ""
                choice = {
                    "index": p * n + j,
                    "text": prompt_text + r.text,
                    "logprobs": None,
                    "finish_reason": FINISH.get(r.finish_reason, r.finish_reason),
                }
                extras(choice, o, ids, r)
                if o["logprobs"] is not None:
                    entries = []
                    if o["echo"]:
                        entries = list(zip(ids, r.prompt_logprobs, r.prompt_top_logprobs))
                    entries += zip(
                        r.token_ids, r.logprobs, r.top_logprobs or [[]] * len(r.logprobs)
                    )
                    choice["logprobs"] = legacy_logprobs(entries, 0, namer(o))
                choices.append(choice)
        prompt_tokens = sum(len(ids) for ids in sub.prompt_ids[::best_of])
        return {
            "id": cid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": choices, "system_fingerprint": None,
            "usage": usage(prompt_tokens, sum(len(r.token_ids) for r, _ in done)),
        }  # fmt: skip

    def echo_text(ids) -> str:
        return state.tokenizer.decode(ids, skip_special_tokens=False)

    def extras(choice: dict, o: dict, ids, r) -> None:
        """vLLM's per-choice fields, when asked for."""
        if o.get("return_token_ids"):
            choice["prompt_token_ids"], choice["token_ids"] = list(ids), list(r.token_ids)
        if o.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(ids, r)

    def continuous(o: dict) -> bool:
        """Usage in every chunk: vLLM's continuous_usage_stats, which needs include_usage."""
        return o["usage"]["include_usage"] and o["usage"]["continuous_usage_stats"]

    async def openai_stream(chunks, o: dict, obj: str, cid, created, prompt_tokens, count):
        """The stream both OpenAI routes send: their chunks, then the usage chunk (with
        include_usage; `count()` is the tokens generated by then) and [DONE]; an error
        mid-stream is its last event."""
        try:
            async for line in chunks:
                yield line
            if o["usage"]["include_usage"]:
                yield sse({"id": cid, "object": obj, "created": created,
                           "model": state.model_name, "choices": [],
                           "usage": usage(prompt_tokens, count())})  # fmt: skip
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield sse(openai_error(e))

    def stream_completions(request, sub: Submission, parsed: Parsed, cid, created):
        o = parsed.options
        # n choices share their prompt: it is counted once (as OpenAI counts it).
        prompt_tokens = sum(len(ids) for ids in sub.prompt_ids[:: o["n"]])
        generated = [0]

        def chunk(index: int, text: str, finish=None, logprobs=None, **more) -> str:
            body = {"id": cid, "object": "text_completion", "created": created,
                    "model": state.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish, **more}]}  # fmt: skip
            if continuous(o):
                body["usage"] = usage(prompt_tokens, generated[0])
            return sse(body)

        async def chunks():
            offsets = [0] * len(sub.prompt_ids)
            for i, ids in enumerate(sub.prompt_ids):
                first = {"prompt_token_ids": list(ids)} if o.get("return_token_ids") else {}
                text = echo_text(ids) if o["echo"] else ""
                if text or first:
                    yield chunk(i, text, **first)
                offsets[i] = len(text)
            async for i, ev in sub.events(request):
                if ev.kind == "token":
                    generated[0] += 1
                    lp = None
                    if o["logprobs"] is not None:
                        lp = legacy_logprobs([(ev.token_id, ev.logprob, ev.top)], offsets[i],
                                             namer(o))  # fmt: skip
                        offsets[i] += len(text_of(ev.token_id))
                    more = {"token_ids": [ev.token_id]} if o.get("return_token_ids") else {}
                    if ev.text or lp or more:
                        yield chunk(i, ev.text, logprobs=lp, **more)
                else:
                    r = ev.result
                    yield chunk(i, ev.text, FINISH.get(r.finish_reason, r.finish_reason))

        return openai_stream(chunks(), o, "text_completion", cid, created, prompt_tokens,
                             lambda: generated[0])  # fmt: skip

    # -- chat ------------------------------------------------------------------------------------
    @router.post("/v1/chat/completions", openapi_extra={"x-mpinfer-body": "ChatRequest"})
    async def chat(request: Request):
        return await respond(request, parse_chat, "chatcmpl", stream_chat, chat_body)

    def chat_choice(o: dict, index: int, r, echoed: str) -> dict:
        logprobs = None
        if o["logprobs"]:
            tops = r.top_logprobs or [[]] * len(r.token_ids)
            logprobs = {"content": [chat_logprob(t, lp, top, namer(o)) for t, lp, top
                                    in zip(r.token_ids, r.logprobs, tops)]}  # fmt: skip
        choice = {
            "index": index,
            "message": {"role": "assistant", "content": echoed + r.text},
            "logprobs": logprobs,
            "finish_reason": FINISH.get(r.finish_reason, r.finish_reason),
        }
        if o.get("return_token_ids"):
            choice["token_ids"] = list(r.token_ids)
        return choice

    def chat_body(parsed: Parsed, sub: Submission, done, cid: str, created: int) -> dict:
        o = parsed.options
        choices = [chat_choice(o, i, r, o["echoed"]) for i, (r, _) in enumerate(done)]
        body = {
            "id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "system_fingerprint": None,
            "usage": usage(len(sub.prompt_ids[0]), sum(len(r.token_ids) for r, _ in done)),
        }  # fmt: skip
        if o.get("return_token_ids"):
            body["prompt_token_ids"] = list(sub.prompt_ids[0])
        if o.get("prompt_logprobs") is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(sub.prompt_ids[0], done[0][0])
        return body

    def batch_chat_body(parsed: Parsed, sub: Submission, done, cid: str, created: int) -> dict:
        """vLLM's batched chat answer: a chat completion with one choice per conversation
        (its prompt's ids and log-probabilities on the choice), usage summed."""
        o = parsed.options
        choices = []
        for i, ((r, _), ids, echoed) in enumerate(zip(done, sub.prompt_ids, o["echoed"])):
            choice = chat_choice(o, i, r, echoed)
            if o.get("return_token_ids"):
                choice["prompt_token_ids"] = list(ids)
            if o.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(ids, r)
            choices.append(choice)
        prompt_tokens = sum(len(ids) for ids in sub.prompt_ids)
        return {
            "id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "system_fingerprint": None,
            "usage": usage(prompt_tokens, sum(len(r.token_ids) for r, _ in done)),
        }  # fmt: skip

    @router.post("/v1/chat/completions/batch",
                 openapi_extra={"x-mpinfer-body": "BatchChatRequest"})  # fmt: skip
    async def batch_chat(request: Request):
        return await respond(request, parse_batch_chat, "chatcmpl-batch", None, batch_chat_body)

    def stream_chat(request, sub: Submission, parsed: Parsed, cid, created):
        o = parsed.options
        prompt_tokens, generated = len(sub.prompt_ids[0]), [0]

        def chunk(index: int, delta: dict, finish=None, logprobs=None) -> str:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": state.model_name, "system_fingerprint": None,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}]}  # fmt: skip
            if continuous(o):
                body["usage"] = usage(prompt_tokens, generated[0])
            return sse(body)

        async def chunks():
            for i in range(len(sub.prompt_ids)):
                yield chunk(i, {"role": "assistant", "content": ""})
                if o["echoed"]:  # vLLM's echo: the last message's content comes first
                    yield chunk(i, {"content": o["echoed"]})
            async for i, ev in sub.events(request):
                if ev.kind == "token":
                    generated[0] += 1
                    lp = None
                    if o["logprobs"]:
                        lp = {"content": [chat_logprob(ev.token_id, ev.logprob, ev.top,
                                                       namer(o))]}  # fmt: skip
                    if ev.text or lp:
                        yield chunk(i, {"content": ev.text}, logprobs=lp)
                else:
                    r = ev.result
                    delta = {"content": ev.text} if ev.text else {}
                    yield chunk(i, delta, FINISH.get(r.finish_reason, r.finish_reason))

        return openai_stream(chunks(), o, "chat.completion.chunk", cid, created, prompt_tokens,
                             lambda: generated[0])  # fmt: skip

    @router.post("/invocations", openapi_extra={"x-mpinfer-body": "CompletionRequest"})
    async def invocations(request: Request):
        """SageMaker's route, as vLLM serves it: a body with `messages` is a chat completion,
        any other a completion."""
        try:
            data = read_json(await request.body(), STATUS)
        except ApiError as e:
            return error(request, e)
        if isinstance(data, dict) and "messages" in data:
            return await respond(request, parse_chat, "chatcmpl", stream_chat, chat_body)
        return await respond(request, parse_completions, "cmpl", stream_completions,
                             completion_body)  # fmt: skip

    @router.get("/version")
    async def version():
        return {"version": __version__}

    @router.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "mpinfer",
                    "root": state.model_name,
                    "parent": None,
                    "max_model_len": state.cfg.server.max_seq_len,
                }
            ],
        }

    return router


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
