"""OpenAI-compatible request parsing: /v1/completions and /v1/chat/completions bodies to engine
jobs, with OpenAI's field names in every error (`max_tokens`, not `max_new_tokens`).

Completions: `prompt` is a string, a list of strings, a list of token ids or a list of lists of
token ids; each prompt gets `n` choices (from `best_of` candidates when it is larger), all
submitted to the engine together. `echo` with `logprobs` (and `max_tokens` 0, as
lm-evaluation-harness sends) returns every prompt token's log-probability. Chat: `messages`
rendered by the chat template (chat.py); `logprobs` and `top_logprobs`; `max_completion_tokens`
or `max_tokens`. Both accept vLLM's extensions that load generators send (`ignore_eos`,
`min_tokens`, `top_k`, `repetition_penalty`, `stream_options.continuous_usage_stats`).
The request, response and error bodies are pydantic models here (CompletionRequest,
ChatRequest, CompletionResponse, OpenAIError): they parse, validate and describe the routes in
/openapi.json. What is not here: the responses (oairoutes.py), shared parsing rules (api.py).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import MAX_TOP_N
from .api import (
    ApiError,
    Body,
    Count,
    Job,
    Parsed,
    SamplingFields,
    check_params,
    nth_seed,
    read_json,
    sampling_params,
    validate,
)
from .streams import State

STATUS = 400
MAX_N = 16
# SamplingParams' names -> OpenAI's, for the messages of the engine's checks.
NAMES = {"max_new_tokens": "max_tokens", "top_n": "logprobs", "prompt_logprobs": "logprobs"}
TokenIds = list[Annotated[int, Field(ge=0)]]
PromptIds = list[int]  # checked against the vocabulary by the engine, in vLLM's words
INT64 = 2**63
MAX_CONVERSATIONS = 64  # /v1/chat/completions/batch


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class OpenAIFields(SamplingFields):
    """What both OpenAI routes accept, vLLM's extensions included (load generators and
    evaluation tools send them)."""

    model: str | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in "
                                                "[-100, 100]")  # fmt: skip
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=2**31)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: TokenIds | None = None
    allowed_token_ids: TokenIds | None = None
    min_p: float = Field(0.0, ge=0, le=1)
    # OpenAI's seeds are signed 64-bit (vLLM's range); the sampler takes them modulo 2**64.
    seed: int | None = Field(None, ge=-INT64, le=INT64 - 1)
    return_token_ids: bool = False
    # vLLM: log-probability entries name tokens `token_id:N`, identifiable whatever their text.
    return_tokens_as_token_ids: bool = False
    # vLLM: with logprobs, these tokens' log-probabilities at every position, in place of the
    # most likely alternatives
    logprob_token_ids: TokenIds | None = Field(None, min_length=1, max_length=MAX_TOP_N)
    # vLLM: the prefix cache is shared only among requests with the same salt (a client that
    # salts its requests cannot have its prompts guessed through the cache's hits)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # -1 is vLLM's "the whole vocabulary": refused above MAX_TOP_N, as vLLM's default refuses it.
    prompt_logprobs: int | None = Field(None, ge=-1, le=2**31)
    # vLLM: keep only this many prompt tokens (-1: as many as max_seq_len allows beside the
    # answer), cut from the start ("left", the default) or the end ("right").
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**31)
    truncation_side: Literal["left", "right"] | None = None


class CompletionRequest(OpenAIFields):
    prompt: str | list[str] | PromptIds | list[PromptIds]
    max_tokens: int | None = Field(None, ge=0, le=2**31)
    suffix: Literal[""] | None = None  # no insertion: only an empty suffix
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class TextPart(Body):
    type: Literal["text"]
    text: str = ""


class Message(Body):
    """A chat message: any role the template renders (vLLM passes custom roles and fields
    through), its other fields handed to the template as they came."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(OpenAIFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # OpenAI's fields that this server accepts only as "not used": tools, formats, storage.
    response_format: dict | None = None
    tools: list | None = None
    functions: list | None = None
    tool_choice: Literal["none", "auto"] | None = None
    function_call: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: None = None
    audio: None = None
    reasoning_effort: str | None = None
    # vLLM: the answer starts with the last message's content when that message is the
    # assistant's (what continue_final_message continues).
    echo: bool = False


class BatchChatRequest(ChatRequest):
    """vLLM's /v1/chat/completions/batch: the chat fields once, several conversations; one
    choice per conversation, in order."""

    messages: list[Annotated[list[Message], Field(min_length=1)]] = Field(
        min_length=1, max_length=MAX_CONVERSATIONS
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict]
    usage: Usage | None = None


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


def fail(key: str, message: str):
    raise ApiError(STATUS, f"{key}: {message}", field=key)


def common_params(r: OpenAIFields, state: State, max_key: str, max_new: int | None):
    """Checks what both routes share; the SamplingParams of one choice, and the usage options."""
    vocab = state.engine.loaded.shape.vocab_size
    usage = {"include_usage": False, "continuous_usage_stats": False}
    if r.stream_options is not None:
        if not r.stream:
            fail("stream_options", "is only allowed with stream: true")
        usage = r.stream_options.model_dump()
    params = sampling_params(r, state.cfg.generation, max_new_key=max_key, max_new=max_new,
                             sample_default=True, names=NAMES, status=STATUS)  # fmt: skip
    most = state.cfg.server.max_token_ids
    params = dataclasses.replace(
        params, logit_bias=logit_bias(r.logit_bias, vocab, state.cfg.server.max_logit_bias),
        allowed_token_ids=token_ids(r.allowed_token_ids, "allowed_token_ids", vocab, most),
        stop_token_ids=token_ids(r.stop_token_ids, "stop_token_ids", vocab, most),
        min_p=r.min_p, skip_special_tokens=r.skip_special_tokens, cache_salt=r.cache_salt or "",
        include_stop_str_in_output=r.include_stop_str_in_output,
    )  # fmt: skip
    return params, usage


def logit_bias(raw: dict | None, vocab: int, most: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a string) -> bias in [-100, 100], at most `most` entries
    (server.max_logit_bias); the 400 names every bad key."""
    raw = raw or {}
    if len(raw) > most:
        fail("logit_bias", f"at most {most} entries (server.max_logit_bias), got {len(raw)}")
    bad = [k for k in raw if not (k.isascii() and k.isdigit() and len(k) <= 12
                                  and int(k) < vocab)]  # fmt: skip
    if bad:
        fail("logit_bias", f"keys must be token ids in [0, {vocab}): {', '.join(map(repr, bad))}")
    named: dict[int, str] = {}
    for k, v in raw.items():
        if not -100 <= v <= 100:
            fail("logit_bias", f"the bias of token {k} must be a number in [-100, 100], got {v!r}")
        if int(k) in named:
            fail("logit_bias", f"keys {named[int(k)]!r} and {k!r} name the same token")
        named[int(k)] = k
    return tuple((int(k), float(v)) for k, v in raw.items())


def token_ids(ids: list[int] | None, key: str, vocab: int, most: int = 0) -> tuple[int, ...]:
    """A list of token ids in the vocabulary, each kept once, at most `most` of them (0: any
    number; server.max_token_ids)."""
    if most and len(ids or ()) > most:
        fail(key, f"at most {most} token ids (server.max_token_ids), got {len(ids)}")
    bad = [t for t in ids or () if t >= vocab]
    if bad:
        fail(key, f"token ids must be integers in [0, {vocab}): {bad[:5]}")
    return tuple(dict.fromkeys(ids or ()))


def parse_completions(body: bytes, state: State) -> Parsed:
    data = read_json(body, STATUS)
    check_prompt(data.get("prompt"), data.get("n"))
    r = validate(CompletionRequest, data, STATUS)
    prompts = r.prompt if isinstance(r.prompt, list) and r.prompt and not isinstance(
        r.prompt[0], int) else [r.prompt]  # fmt: skip
    logprobs = r.logprobs
    params, usage = common_params(r, state, "max_tokens", r.max_tokens)
    n = r.n
    best_of = n if r.best_of is None else r.best_of
    if best_of < n:
        fail("best_of", f"must be >= n ({n}), got {best_of}")
    if best_of > n and r.stream:
        fail("best_of", "best_of > n cannot be streamed")
    if r.stream and r.echo and logprobs is not None:
        fail("echo", "echo with logprobs cannot be streamed (the prompt's come with the answer)")
    extra = vllm_options(r, state)
    k = (logprobs or 0) if r.echo and logprobs is not None else -1
    if extra["prompt_logprobs"] is None and k >= 0 and not r.stream:
        extra["prompt_logprobs"] = k  # vLLM: echo with logprobs returns them as prompt_logprobs
    if extra["prompt_logprobs"] is not None:
        k = max(k, extra["prompt_logprobs"])
    if params.max_new_tokens == 0 and k < 0:
        fail("max_tokens", "0 generates nothing: it needs echo with logprobs (prompt scoring)")
    params = dataclasses.replace(params, top_n=logprobs or 0, prompt_logprobs=k)
    params = named_alternatives(r, params, state, logprobs is not None, "logprobs")
    check_params(params, STATUS, "", NAMES)
    cut, keep_start = truncation(r, state, params)
    jobs = tuple(Job(p, nth_seed(params, j), cut, keep_start) for p in prompts
                 for j in range(best_of))  # fmt: skip
    return Parsed(jobs, stream=r.stream, options={
        "n": n, "best_of": best_of, "echo": r.echo, "logprobs": logprobs, "usage": usage,
        "prompts": prompts, **extra,
    })  # fmt: skip


def truncation(r: OpenAIFields, state: State, params) -> tuple[int | None, bool]:
    """vLLM's truncate_prompt_tokens and truncation_side as a Job's (tokens kept, from the
    start?): -1 keeps what max_seq_len leaves beside max_tokens; 0 would keep nothing."""
    n = r.truncate_prompt_tokens
    if n is None:
        if r.truncation_side is not None:
            fail("truncation_side", "needs truncate_prompt_tokens")
        return None, False
    if n == 0:
        fail("truncate_prompt_tokens", "0 would leave no prompt: use -1 (what max_seq_len "
             "allows) or a positive number")  # fmt: skip
    if n == -1:
        n = state.cfg.server.max_seq_len - params.max_new_tokens
        if n < 1:
            fail("truncate_prompt_tokens", f"-1 keeps max_seq_len - max_tokens = {n} tokens")
    return n, r.truncation_side == "right"


def named_alternatives(r: OpenAIFields, params, state: State, asked: bool, needs: str):
    """vLLM's logprob_token_ids: the alternatives reported at each position are these tokens
    (in the order given), not the most likely ones; they need logprobs."""
    ids = r.logprob_token_ids
    if not ids:
        return params
    if not asked:
        fail("logprob_token_ids", f"needs {needs}")
    if len(set(ids)) != len(ids):
        fail("logprob_token_ids", "each token id at most once")
    ids = token_ids(ids, "logprob_token_ids", state.engine.loaded.shape.vocab_size)
    return dataclasses.replace(params, top_n=len(ids), logprob_token_ids=ids)


def vllm_options(r: OpenAIFields, state: State) -> dict:
    """vLLM's response extensions: return_token_ids, return_tokens_as_token_ids,
    prompt_logprobs (not streamed here; at most MAX_TOP_N alternatives, as vLLM's default
    --max-logprobs)."""
    n = r.prompt_logprobs
    if n is not None and r.stream:
        fail("prompt_logprobs", "is returned with the whole answer only: not with stream")
    if n is not None and (n < 0 or n > MAX_TOP_N):
        vocab = state.engine.loaded.shape.vocab_size
        asked = f"-1 (the whole vocabulary, {vocab} tokens)" if n < 0 else str(n)
        fail("prompt_logprobs", f"Requested prompt logprobs of {asked}, which is greater than "
             f"max allowed: {MAX_TOP_N}")  # fmt: skip
    return {
        "return_token_ids": r.return_token_ids,
        "prompt_logprobs": n,
        "return_tokens_as_token_ids": r.return_tokens_as_token_ids,
    }


def check_prompt(value, n) -> None:
    """OpenAI's four prompt forms, with a message that says which (before the model, whose
    union errors would list every form): non-empty, and at most 4 x MAX_N choices."""
    expected = "expected a string, a list of strings, a list of token ids or a list of lists"
    if isinstance(value, str) or isinstance(value, list) and value and all(map(is_int, value)):
        value = [value]
    if not isinstance(value, list) or not value:
        fail("prompt", f"{expected} (non-empty)")
    for i, p in enumerate(value):
        if not (isinstance(p, str) or isinstance(p, list) and all(map(is_int, p))):
            fail("prompt", f"{expected}; item {i} is neither")
        if not p:
            fail("prompt", f"item {i} is empty")
    if len(value) * (n if is_int(n) else 1) > 4 * MAX_N:
        fail("prompt", f"at most {4 * MAX_N} choices a request (prompts x n)")


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_chat(body: bytes, state: State) -> Parsed:
    return chat_jobs(validate(ChatRequest, read_json(body, STATUS), STATUS), state)


def parse_batch_chat(body: bytes, state: State) -> Parsed:
    """vLLM's batched chat: each conversation parsed as a chat request of its own with the
    shared fields; one choice each (n 1), not streamed."""
    r = validate(BatchChatRequest, read_json(body, STATUS), STATUS)
    if r.stream:
        fail("stream", "the batch route answers with one JSON body: use /v1/chat/completions "
             "to stream")  # fmt: skip
    if r.n != 1:
        fail("n", "the batch route gives one choice per conversation (n 1)")
    parts = [chat_jobs(r.model_copy(update={"messages": conv}), state) for conv in r.messages]
    options = {**parts[0].options, "echoed": [p.options["echoed"] for p in parts]}
    return Parsed(tuple(j for p in parts for j in p.jobs), stream=False, options=options)


def chat_jobs(r: ChatRequest, state: State) -> Parsed:
    messages = message_list(r.messages)
    for key in ("tools", "functions"):
        if getattr(r, key):
            fail(key, "tool calls are not supported")
    if r.response_format is not None and r.response_format.get("type") != "text":
        fail("response_format", "only {'type': 'text'} is supported")
    add_prompt = True if r.add_generation_prompt is None else r.add_generation_prompt
    if r.continue_final_message and r.add_generation_prompt is True:
        fail("continue_final_message", "cannot be combined with add_generation_prompt: true")
    if r.continue_final_message and messages[-1]["role"] != "assistant":
        fail("continue_final_message", "needs an assistant message last, to continue")
    key = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    if r.top_logprobs is not None and not r.logprobs:
        fail("top_logprobs", "needs logprobs: true")
    params, usage = common_params(r, state, key, getattr(r, key))
    extra = vllm_options(r, state)
    if r.echo and extra["prompt_logprobs"] is None and not r.stream:
        extra["prompt_logprobs"] = r.top_logprobs or 0  # vLLM: echo returns prompt_logprobs
    plp = -1 if extra["prompt_logprobs"] is None else extra["prompt_logprobs"]
    params = dataclasses.replace(params, top_n=r.top_logprobs or 0, prompt_logprobs=plp)
    params = named_alternatives(r, params, state, r.logprobs, "logprobs: true")
    prompt = render_chat(state.chat, messages, add_generation_prompt=add_prompt,
                         continue_final_message=r.continue_final_message)  # fmt: skip
    cut, keep_start = truncation(r, state, params)
    jobs = tuple(Job(prompt, nth_seed(params, j), cut, keep_start) for j in range(r.n))
    # vLLM's echo: the last message's content, when it is the role the answer takes.
    echoed = messages[-1]["content"] if r.echo and messages[-1]["role"] == "assistant" else ""
    return Parsed(jobs, stream=r.stream, options={"n": r.n, "logprobs": r.logprobs,
                                                  "usage": usage, "max_key": key,
                                                  "echoed": echoed, **extra})  # fmt: skip


def render_chat(chat, messages: list[dict], **options) -> str:
    """The chat template's prompt; whatever stops it (its own raise_exception, a Jinja fault,
    its time or size budget, a recursion) is this request's 400 naming `messages`."""
    try:
        return chat.render(messages, **options)
    except Exception as e:
        raise ApiError(STATUS, f"messages: the chat template refused them: {e}",
                       field="messages") from None  # fmt: skip


def message_list(messages: list[Message]) -> list[dict]:
    """Validated messages as [{"role", "content": str, ...}]: text parts joined, an
    assistant's missing content empty, "developer" as "system", any other field kept (the
    template may read it)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        elif content is None:
            if m.role != "assistant":
                fail(f"messages[{i}].content", "expected a string or a list of text parts")
            content = ""
        role = "system" if m.role == "developer" else m.role
        named = {"name": m.name} if m.name is not None else {}
        out.append({**(m.model_extra or {}), **named, "role": role, "content": content})
    return out
