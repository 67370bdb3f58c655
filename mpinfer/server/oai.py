"""OpenAI-compatible request parsing: /v1/completions and /v1/chat/completions bodies to engine
jobs, with OpenAI's field names in every error (`max_tokens`, not `max_new_tokens`).

Completions: `prompt` is a string, a list of strings, a list of token ids or a list of lists of
token ids; each prompt gets `n` choices (from `best_of` candidates when it is larger), all
submitted to the engine together. `echo` with `logprobs` (and `max_tokens` 0, as
lm-evaluation-harness sends) returns every prompt token's log-probability. Chat: `messages`
rendered by the chat template (chat.py); `logprobs` and `top_logprobs`; `max_completion_tokens`
or `max_tokens`. Both accept vLLM's extensions that load generators send (`ignore_eos`,
`min_tokens`, `top_k`, `repetition_penalty`, `stream_options.continuous_usage_stats`).
What is not here: the responses (oairoutes.py), shared parsing rules (api.py).
"""

from __future__ import annotations

import dataclasses

from ..engine.sampling import MAX_TOP_N
from .api import ApiError, Fields, Job, Parsed, check_params, check_text, read_json, sampling_params
from .streams import State

STATUS = 400
MAX_N = 16
COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
    # vLLM's extensions (load generators and evaluation tools send them)
    "top_k", "repetition_penalty", "typical_p", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "stop_token_ids", "min_p",
    "allowed_token_ids", "return_token_ids", "prompt_logprobs",
}  # fmt: skip
COMPLETION_FIELDS = COMMON | {"prompt", "suffix", "echo", "best_of"}
CHAT_FIELDS = COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "store", "metadata",
    "service_tier", "modalities", "prediction", "audio", "reasoning_effort",
    "add_generation_prompt", "continue_final_message", "echo",
}  # fmt: skip
# SamplingParams' names -> OpenAI's, for the messages of the engine's checks.
NAMES = {"max_new_tokens": "max_tokens", "top_n": "logprobs", "prompt_logprobs": "logprobs"}


def common_params(f: Fields, state: State, max_key: str, *, zero_ok: bool):
    """Checks every field both routes share; the SamplingParams of one choice."""
    f.get("model", "str")
    f.get("user", "str")
    vocab = state.engine.loaded.shape.vocab_size
    stream = f.get("stream", "bool", False)
    options = f.get("stream_options", "object")
    usage = {"include_usage": False, "continuous_usage_stats": False}
    if options is not None:
        if not stream:
            f.fail("stream_options", "is only allowed with stream: true")
        o = Fields(options, STATUS, "stream_options.")
        o.reject_unknown(set(usage))
        usage = {k: bool(o.get(k, "bool", False)) for k in usage}
    max_new = f.ranged(max_key, "int", 0 if zero_ok else 1, 2**31)
    params = sampling_params(f, state.cfg.generation, max_new_key=max_key, max_new=max_new,
                             sample_default=True, names=NAMES)  # fmt: skip
    params = dataclasses.replace(
        params, logit_bias=logit_bias(f, vocab),
        allowed_token_ids=token_ids(f, "allowed_token_ids", vocab),
        stop_token_ids=token_ids(f, "stop_token_ids", vocab),
        min_p=f.ranged("min_p", "float", 0.0, 1.0, 0.0),
        skip_special_tokens=f.get("skip_special_tokens", "bool", True),
        include_stop_str_in_output=f.get("include_stop_str_in_output", "bool", False),
    )  # fmt: skip
    n = f.ranged("n", "int", 1, MAX_N, 1)
    return params, stream, usage, n


def logit_bias(f: Fields, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a string) -> bias in [-100, 100]; the 400 names every bad key."""
    raw = f.get("logit_bias", "object") or {}
    bad = [k for k in raw if not (k.isdigit() and int(k) < vocab)]
    if bad:
        f.fail("logit_bias", f"keys must be token ids in [0, {vocab}): {', '.join(map(repr, bad))}")
    out = []
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            f.fail(
                "logit_bias", f"the bias of token {k} must be a number in [-100, 100], got {v!r}"
            )
        out.append((int(k), float(v)))
    return tuple(out)


def token_ids(f: Fields, key: str, vocab: int) -> tuple[int, ...]:
    ids = f.get(key, "list") or []
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        f.fail(key, f"token ids must be integers in [0, {vocab}): {bad[:5]}")
    return tuple(ids)


def parse_completions(body: bytes, state: State) -> Parsed:
    data = read_json(body, STATUS)
    f = Fields(data, STATUS)
    f.reject_unknown(COMPLETION_FIELDS)
    prompts = prompt_list(data.get("prompt"), f)
    f.reject_set("suffix", "is not supported", (None, ""))
    echo = bool(f.get("echo", "bool", False))
    logprobs = f.ranged("logprobs", "int", 0, MAX_TOP_N)
    params, stream, usage, n = common_params(f, state, "max_tokens", zero_ok=True)
    best_of = f.ranged("best_of", "int", 1, MAX_N, n)
    if best_of < n:
        f.fail("best_of", f"must be >= n ({n}), got {best_of}")
    if best_of > n and stream:
        f.fail("best_of", "best_of > n cannot be streamed")
    if stream and echo and logprobs is not None:
        f.fail("echo", "echo with logprobs cannot be streamed (the prompt's come with the answer)")
    extra = vllm_options(f, stream)
    k = (logprobs or 0) if echo and logprobs is not None else -1
    if extra["prompt_logprobs"] is not None:
        k = max(k, extra["prompt_logprobs"])
    if params.max_new_tokens == 0 and k < 0:
        f.fail("max_tokens", "0 generates nothing: it needs echo with logprobs (prompt scoring)")
    params = dataclasses.replace(params, top_n=logprobs or 0, prompt_logprobs=k)
    check_params(params, f, NAMES)
    jobs = tuple(Job(p, nth_seed(params, j)) for p in prompts for j in range(best_of))
    return Parsed(jobs, stream=stream, options={
        "n": n, "best_of": best_of, "echo": echo, "logprobs": logprobs, "usage": usage,
        "prompts": prompts, **extra,
    })  # fmt: skip


def vllm_options(f: Fields, stream: bool) -> dict:
    """vLLM's response extensions: return_token_ids, prompt_logprobs (not streamed here)."""
    plp = f.ranged("prompt_logprobs", "int", 0, MAX_TOP_N)
    if plp is not None and stream:
        f.fail("prompt_logprobs", "is returned with the whole answer only: not with stream")
    return {
        "return_token_ids": bool(f.get("return_token_ids", "bool", False)),
        "prompt_logprobs": plp,
    }


def prompt_list(value, f: Fields) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts (each a string or token ids)."""
    expected = "expected a string, a list of strings, a list of token ids or a list of lists"
    if (
        isinstance(value, str)
        or isinstance(value, list)
        and value
        and all(is_int(t) for t in value)
    ):
        value = [value]
    if not isinstance(value, list) or not value:
        f.fail("prompt", f"{expected} (non-empty)")
    out = []
    for i, p in enumerate(value):
        if isinstance(p, str):
            check_text(p, f"prompt[{i}]", STATUS)
        elif not (isinstance(p, list) and all(is_int(t) for t in p)):
            f.fail("prompt", f"{expected}; item {i} is neither")
        if not p:
            f.fail("prompt", f"item {i} is empty")
        out.append(p)
    if len(out) * (f.data.get("n") if is_int(f.data.get("n")) else 1) > 4 * MAX_N:
        f.fail("prompt", f"at most {4 * MAX_N} choices a request (prompts x n)")
    return out


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def nth_seed(params, j: int):
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**64)


def parse_chat(body: bytes, state: State) -> Parsed:
    data = read_json(body, STATUS)
    f = Fields(data, STATUS)
    f.reject_unknown(CHAT_FIELDS)
    messages = message_list(data.get("messages"), f)
    for key in ("tools", "functions"):
        if f.get(key, "list"):
            f.fail(key, "tool calls are not supported")
    f.reject_set("tool_choice", "tool calls are not supported", (None, "none", "auto"))
    f.reject_set("function_call", "function calls are not supported", (None, "none", "auto"))
    f.get("parallel_tool_calls", "bool")
    fmt = f.get("response_format", "object")
    if fmt is not None and fmt.get("type") != "text":
        f.fail("response_format", "only {'type': 'text'} is supported")
    add_prompt = f.get("add_generation_prompt", "bool", True)
    continue_final = f.get("continue_final_message", "bool", False)
    if continue_final and data.get("add_generation_prompt") is True:
        f.fail("continue_final_message", "cannot be combined with add_generation_prompt: true")
    if continue_final and messages[-1]["role"] != "assistant":
        f.fail("continue_final_message", "needs an assistant message last, to continue")
    f.reject_set("echo", "is not supported for chat", (None, False))
    f.reject_set("modalities", "only text is supported", (None, ["text"]))
    for key in ("prediction", "audio"):
        f.reject_set(key, "is not supported")
    for key in ("store", "metadata", "service_tier", "reasoning_effort"):
        f.get(key, {"store": "bool", "metadata": "object"}.get(key, "str"))
    key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    logprobs = bool(f.get("logprobs", "bool", False))
    top = f.ranged("top_logprobs", "int", 0, MAX_TOP_N)
    if top is not None and not logprobs:
        f.fail("top_logprobs", "needs logprobs: true")
    params, stream, usage, n = common_params(f, state, key, zero_ok=False)
    extra = vllm_options(f, stream)
    plp = -1 if extra["prompt_logprobs"] is None else extra["prompt_logprobs"]
    params = dataclasses.replace(params, top_n=top or 0, prompt_logprobs=plp)
    try:
        prompt = state.chat.render(messages, add_generation_prompt=add_prompt,
                                   continue_final_message=continue_final)  # fmt: skip
    except Exception as e:  # a template's own raise_exception, or any Jinja fault
        raise ApiError(STATUS, f"messages: the chat template refused them: {e}",
                       field="messages") from None  # fmt: skip
    jobs = tuple(Job(prompt, nth_seed(params, j)) for j in range(n))
    return Parsed(jobs, stream=stream, options={"n": n, "logprobs": logprobs, "usage": usage,
                                                "max_key": key, **extra})  # fmt: skip


ROLES = ("system", "developer", "user", "assistant")


def message_list(value, f: Fields) -> list[dict]:
    """`messages` as [{"role", "content": str}], text parts joined; errors name the item."""
    if not isinstance(value, list) or not value:
        f.fail("messages", "expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            f.fail(where, "expected an object with role and content")
        g = Fields(m, STATUS, where + ".")
        g.reject_unknown({"role", "content", "name"})
        role = g.get("role", "str")
        if role not in ROLES:
            g.fail("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        g.get("name", "str")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                p = Fields(part if isinstance(part, dict) else {}, STATUS,
                           f"{where}.content[{j}].")  # fmt: skip
                if not isinstance(part, dict) or part.get("type") != "text":
                    p.fail("type", "only text parts are supported")
                p.reject_unknown({"type", "text"})
                texts.append(p.get("text", "str", ""))
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            g.fail("content", "expected a string or a list of text parts")
        check_text(content, where + ".content", STATUS)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out
