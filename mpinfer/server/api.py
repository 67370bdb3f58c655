"""What every HTTP route shares before a request reaches the engine: the body read as a JSON
object, the pydantic base of the request models (`Body`: strict types, no unknown field) and
`validate`, whose errors name the field as the request wrote it, the sampling fields every
generating route shares and the SamplingParams built from them on top of the config's
[generation] defaults, and both formats of error body. TGI routes answer 422 for bad input,
OpenAI routes 400.

Nothing a client sends reaches the sampler unchecked: every number is range-checked against what
the sampler computes (sampling.SamplingParams.check), integers beyond their range and non-finite
numbers are refused, strings with lone surrogates (invalid Unicode) are refused, a body that
nests deeper than Python's JSON reader can follow is refused. No FastAPI here, so each rule is
testable on its own. What is not here: each face's own models (tgi.py, oai.py, routes.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import GenerationConfig
from ..engine.sampling import MAX_STOP, MIN_TEMPERATURE, SamplingParams

INT64 = 2**63
MAX_STOP_CHARS = 1000  # a stop string is searched in every token's text: keep it short


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, field: str = "", kind: str = "validation"):
        super().__init__(message)
        self.status, self.message, self.field, self.kind = status, message, field, kind


@dataclass(frozen=True)
class Job:
    """One generation a request asks for: the prompt (text, or token ids) and its parameters."""

    prompt: str | list[int]
    params: SamplingParams
    truncate: int | None = None  # keep only this many of the prompt's tokens (TGI's `truncate`)
    keep_start: bool = False  # ... its first ones instead of its last (vLLM's truncation_side)


@dataclass(frozen=True)
class Parsed:
    """A parsed request: its jobs (one per prompt and choice) and how to answer it."""

    jobs: tuple[Job, ...]
    stream: bool = False
    options: dict = field(default_factory=dict)  # route-specific: details, echo, usage, ...


DUMP_SLICE = 512  # entries of a long list written by one call of the C encoder


def dumps(value) -> str:
    """JSON as the answers send it (what `json.dumps` writes, compact, no NaN), long lists
    written a slice at a time: the C encoder holds the interpreter lock for a whole call, so one
    call over 16 MB of log-probabilities kept the event loop (on another thread) waiting half a
    second; between slices it gets its turn. Dicts and short lists that hold containers are
    written by their parts; a per-token list's entries are small, so a slice of them is one call."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{_key(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        if len(value) > DUMP_SLICE:
            starts = range(0, len(value), DUMP_SLICE)
            parts = (_dump(value[i : i + DUMP_SLICE])[1:-1] for i in starts)
            return "[" + ",".join(parts) + "]"
        if any(isinstance(v, (dict, list)) and not _flat(v) for v in value):
            return "[" + ",".join(dumps(v) for v in value) + "]"
    return _dump(value)


def _flat(container) -> bool:
    items = container.values() if isinstance(container, dict) else container
    return not any(isinstance(v, (dict, list)) for v in items)


def _key(key) -> str:
    # json.dumps turns int, float, bool and None keys into their JSON text, as a string
    return _dump(key if isinstance(key, str) else _dump(key))


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


async def json_off_loop(build) -> bytes:
    """The JSON answer `build()` makes, built and serialized (`dumps`) on a worker thread: a
    prompt's log-probabilities can be megabytes, and the event loop serves every other client
    meanwhile. The route sends the bytes as an application/json body."""
    return await asyncio.to_thread(lambda: dumps(build()).encode())


def read_json(body: bytes, status: int) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(status, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(status, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(status, "request body nests too deeply to read") from None
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise ApiError(status, f"request body holds a number too large to read: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(status, "request body must be a JSON object")
    where = too_deep(data)
    if where is not None:  # every reader after this one recurses: refuse it here
        raise ApiError(status, f"{where}: nests deeper than {MAX_DEPTH} levels", field=where)
    try:  # JSON's \ud800 escapes make strings (keys too) that are not valid Unicode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        where = surrogate_at(data)
        message = f"{where}: invalid Unicode (a lone surrogate)"
        raise ApiError(status, message, field=where) from None
    return data


MAX_DEPTH = 32  # objects and lists in a body: a chat message with content parts is 5 deep


def too_deep(data) -> str | None:
    """Where a parsed body first goes deeper than MAX_DEPTH (walked without recursion)."""
    stack = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            return where or "body"
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1)
                         for k, v in value.items() if isinstance(v, (dict, list)))  # fmt: skip
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1)
                         for i, v in enumerate(value) if isinstance(v, (dict, list)))  # fmt: skip
    return None


def surrogate_at(value, where: str = "") -> str | None:
    """Where in a parsed body the first string (or key) with a lone surrogate is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
        value, list) else ()  # fmt: skip
    for key, item in items:
        at = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
        if isinstance(key, str) and surrogate_at(key) is not None:
            return f"{where or 'body'}: a key"
        found = surrogate_at(item, at)
        if found is not None:
            return found
    return None


def check_text(value: str, where: str, status: int) -> str:
    """`value` unless it holds a lone surrogate (JSON's \\ud800 escapes make invalid Unicode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(status, f"{where}: invalid Unicode (a lone surrogate at character "
                       f"{e.start})", field=where) from None  # fmt: skip
    return value


class Body(BaseModel):
    """A request body (or a nested object of one): strict types as JSON has them (an integer is
    not a boolean, a string is not a number), finite numbers, and no field it does not declare.
    A null is read as an absent field (`validate` drops it first)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def validate(model: type[Body], data: dict, status: int, *, prefix: str = "") -> Body:
    """`data` as `model`; the first error becomes an ApiError naming the field as the request
    wrote it (`parameters.top_k`, `messages[0].role`)."""
    try:
        return model.model_validate(drop_nulls(data))
    except ValidationError as e:
        raise api_error(e, data, status, prefix) from None


def drop_nulls(value):
    """Objects without their null fields, at every depth (lists are walked only when they hold
    objects: a prompt of 2,000 token ids is not)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) if isinstance(v, (dict, list)) else v
                for k, v in value.items() if v is not None}  # fmt: skip
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        return [drop_nulls(v) for v in value]
    return value


def api_error(e: ValidationError, data, status: int, prefix: str) -> ApiError:
    """The error that goes deepest into the request (a union's other branches fail sooner),
    its location written as the request's path; pydantic's union tags left out."""
    best, best_path, best_depth = None, "", -1
    for err in e.errors():
        node, path, depth = data, prefix.rstrip("."), 0
        for part in err["loc"]:
            if isinstance(part, int) and isinstance(node, list) and part < len(node):
                node, path = node[part], f"{path}[{part}]"
            elif isinstance(node, dict) and part in node:
                node, path = node[part], f"{path}.{part}" if path else str(part)
            else:
                continue  # a union member's tag, not a place in the request
            depth += 1
        if err["type"] == "extra_forbidden" or depth > best_depth:
            best, best_path, best_depth = err, path, depth
            if err["type"] == "extra_forbidden":
                break
    kind = best["type"]
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind.endswith("_type") and "input" in best:
        message = f"{best['msg'].lower()}, got {json_type(best['input'])}"
    else:
        message = best["msg"][0].lower() + best["msg"][1:]
        if "input" in best and not isinstance(best["input"], (dict, list)):
            message += f", got {best['input']!r}"
        if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            message += f" ({kind})"  # pydantic's name for the bound, as vLLM's errors give it
    where = best_path or "body"
    return ApiError(status, f"{where}: {message}", field=best_path)


def check_stop(stop, where: str, status: int) -> tuple[str, ...]:
    """A stop string or list as a tuple: at most MAX_STOP, each 1 to MAX_STOP_CHARS characters."""
    if stop is None:
        return ()
    value = [stop] if isinstance(stop, str) else list(stop)
    if len(value) > MAX_STOP:
        raise ApiError(status, f"{where}: at most {MAX_STOP} stop strings, got {len(value)}",
                       field=where)  # fmt: skip
    for s in value:
        check_text(s, where, status)
        if not s or len(s) > MAX_STOP_CHARS:
            raise ApiError(status, f"{where}: each stop string must have 1 to {MAX_STOP_CHARS} "
                           "characters", field=where)  # fmt: skip
    return tuple(value)


# Field types of the request models: integers of 64 bits, positive sizes of 31.
Count = Annotated[int, Field(ge=1, le=2**31)]
Stop = str | list[str]


class SamplingFields(Body):
    """The sampling controls every generating route shares (their ranges are the sampler's)."""

    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0, lt=INT64)
    top_p: float | None = Field(None, gt=0, le=1)
    typical_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: Stop | None = None


def json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip


def sampling_params(
    m: SamplingFields, defaults: GenerationConfig, *, max_new_key: str, max_new: int | None,
    sample_default: bool, names: dict[str, str], status: int, prefix: str = "",
) -> SamplingParams:  # fmt: skip
    """SamplingParams from a request's fields on top of the config's [generation] defaults.
    Sampling happens when `do_sample` says so, else when any sampling control is given (or
    `sample_default`); a temperature below MIN_TEMPERATURE, 0 included, is greedy on every
    route. `names` maps SamplingParams fields to the request's own names for errors."""
    temperature, top_k, top_p, typical_p = m.temperature, m.top_k, m.top_p, m.typical_p
    extra = m.__dict__  # the fields only some routes have (a model keeps its values here)
    do_sample = extra.get("do_sample")
    if do_sample is None:
        do_sample = defaults.do_sample or sample_default
        do_sample = do_sample or any(v is not None for v in (top_k, top_p, typical_p))
        if temperature is not None:
            do_sample = temperature >= MIN_TEMPERATURE
    seed = None if m.seed is None else m.seed % 2**64  # OpenAI's are signed
    if seed is None and defaults.seed >= 0:
        seed = defaults.seed

    def given(value, default):
        return default if value is None else value

    params = SamplingParams(
        max_new_tokens=defaults.max_new_tokens if max_new is None else max_new,
        do_sample=bool(do_sample),
        temperature=given(temperature, defaults.temperature),
        top_k=given(top_k, defaults.top_k),
        top_p=given(top_p, defaults.top_p),
        typical_p=given(typical_p, defaults.typical_p),
        repetition_penalty=given(m.repetition_penalty, defaults.repetition_penalty),
        frequency_penalty=given(m.frequency_penalty, 0.0),
        presence_penalty=given(extra.get("presence_penalty"), 0.0),
        seed=seed,
        stop=check_stop(m.stop, prefix + "stop", status),
        ignore_eos=bool(extra.get("ignore_eos", False)),
        min_tokens=extra.get("min_tokens", 0),
    )
    return check_params(params, status, prefix, {"max_new_tokens": max_new_key, **names})


def nth_seed(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of a request's several choices: its own seed, one past the previous one's."""
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**64)


def check_params(params: SamplingParams, status: int, prefix: str,
                 names: dict[str, str]) -> SamplingParams:  # fmt: skip
    """params.check(), its message naming the request's field (prefixed for nested objects)."""
    try:
        return params.check()
    except ValueError as e:
        raise ApiError(status, prefix + rename(str(e), names),
                       field=prefix + field_of(str(e), names)) from None  # fmt: skip


def rename(message: str, names: dict[str, str]) -> str:
    """An engine or SamplingParams message in the request's own field names."""
    for ours, theirs in sorted(names.items(), key=lambda kv: -len(kv[0])):
        message = message.replace(ours, theirs)
    return message


def field_of(message: str, names: dict[str, str]) -> str:
    key = message.split("=", 1)[0].split(":", 1)[0].strip()
    return names.get(key, key)


def tgi_error(e: ApiError) -> dict:
    return {"error": e.message, "error_type": e.kind, "field": e.field}


def openai_error(e: ApiError) -> dict:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.field or None,
                      "code": e.status}}  # fmt: skip


def finite(x: float | None) -> float | None:
    """A log-probability for JSON: -inf (a token the model cannot produce) becomes None."""
    return x if x is not None and math.isfinite(x) else None
