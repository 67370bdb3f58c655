"""What every HTTP route shares before a request reaches the engine: the body read as a JSON
object, typed getters that name the field they reject, the sampling parameters built from a
request's fields on top of the config's [generation] defaults, and both formats of error body.
TGI routes answer 422 for bad input, OpenAI routes 400.

Nothing a client sends reaches the sampler unchecked: every number is range-checked against what
the sampler computes (sampling.SamplingParams.check), integers beyond int64 and non-finite
numbers are refused, strings with lone surrogates (invalid Unicode) are refused, a body that
nests deeper than Python's JSON reader can follow is refused. No FastAPI here, so each rule is
testable on its own. What is not here: each route family's own fields (tgi.py, oai.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

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
    truncate: int | None = None  # keep only the prompt's last tokens (TGI's `truncate`)


@dataclass(frozen=True)
class Parsed:
    """A parsed request: its jobs (one per prompt and choice) and how to answer it."""

    jobs: tuple[Job, ...]
    stream: bool = False
    options: dict = field(default_factory=dict)  # route-specific: details, echo, usage, ...


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
    try:  # JSON's \ud800 escapes make strings (keys too) that are not valid Unicode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        where = surrogate_at(data)
        message = f"{where}: invalid Unicode (a lone surrogate)"
        raise ApiError(status, message, field=where) from None
    return data


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


class Fields:
    """Typed getters over one JSON object; every error names the field (with its prefix)."""

    def __init__(self, data: dict, status: int, prefix: str = ""):
        self.data, self.status, self.prefix = data, status, prefix

    def fail(self, key: str, msg: str):
        raise ApiError(self.status, f"{self.prefix}{key}: {msg}", field=self.prefix + key)

    def get(self, key: str, kind: str, default: Any = None) -> Any:
        """kind: int | float | bool | str | object | list; None (absent or null) -> default."""
        value = self.data.get(key)
        if value is None:
            return default
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "object": isinstance(value, dict),
            "list": isinstance(value, list),
        }[kind]
        if not ok:
            self.fail(key, f"expected {kind}, got {json_type(value)}")
        if kind == "int" and not -INT64 <= value < 2 * INT64:
            self.fail(key, f"{value} is outside the 64-bit integer range")
        if kind == "float":
            value = float(value) if abs(value) < 1e308 or isinstance(value, float) else math.inf
            if not math.isfinite(value):
                self.fail(key, f"must be a finite number, got {value}")
        if kind == "str":
            check_text(value, self.prefix + key, self.status)
        return value

    def ranged(self, key: str, kind: str, lo, hi, default=None):
        value = self.get(key, kind, default)
        if value is not None and not lo <= value <= hi:
            self.fail(key, f"must be in [{lo}, {hi}], got {value}")
        return value

    def stop_list(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            self.fail(key, "expected a string or a list of strings")
        if len(value) > MAX_STOP:
            self.fail(key, f"at most {MAX_STOP} stop strings, got {len(value)}")
        for s in value:
            check_text(s, self.prefix + key, self.status)
            if not s or len(s) > MAX_STOP_CHARS:
                self.fail(key, f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return tuple(value)

    def reject_unknown(self, known: set[str]) -> None:
        for key in self.data:
            if key not in known:
                self.fail(key, "unknown field")

    def reject_set(self, key: str, why: str, allowed=(None,)) -> None:
        """`key` may only be absent or one of `allowed` (accepted for compatibility)."""
        if self.data.get(key) not in allowed:
            self.fail(key, why)


def json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip


def sampling_params(
    f: Fields, defaults: GenerationConfig, *, max_new_key: str, max_new: int | None,
    sample_default: bool, names: dict[str, str],
) -> SamplingParams:  # fmt: skip
    """SamplingParams from a request's fields on top of the config's [generation] defaults.
    Sampling happens when `do_sample` says so, else when any sampling control is given (or
    `sample_default`); a temperature below MIN_TEMPERATURE, 0 included, is greedy on every
    route. `names` maps SamplingParams fields to the request's own names for errors."""
    temperature = f.get("temperature", "float")
    top_k, top_p = f.get("top_k", "int"), f.get("top_p", "float")
    typical_p = f.get("typical_p", "float")
    do_sample = f.get("do_sample", "bool")
    if do_sample is None:
        do_sample = defaults.do_sample or sample_default
        do_sample = do_sample or any(v is not None for v in (top_k, top_p, typical_p))
        if temperature is not None:
            do_sample = temperature >= MIN_TEMPERATURE
    seed = f.get("seed", "int")
    if seed is None and defaults.seed >= 0:
        seed = defaults.seed
    params = SamplingParams(
        max_new_tokens=defaults.max_new_tokens if max_new is None else max_new,
        do_sample=bool(do_sample),
        temperature=defaults.temperature if temperature is None else temperature,
        top_k=defaults.top_k if top_k is None else top_k,
        top_p=defaults.top_p if top_p is None else top_p,
        typical_p=defaults.typical_p if typical_p is None else typical_p,
        repetition_penalty=f.get("repetition_penalty", "float", defaults.repetition_penalty),
        frequency_penalty=f.get("frequency_penalty", "float", 0.0),
        presence_penalty=f.get("presence_penalty", "float", 0.0),
        seed=seed,
        stop=f.stop_list("stop"),
        ignore_eos=bool(f.get("ignore_eos", "bool", False)),
        min_tokens=f.get("min_tokens", "int", 0),
    )
    return check_params(params, f, {"max_new_tokens": max_new_key, **names})


def check_params(params: SamplingParams, f: Fields, names: dict[str, str]) -> SamplingParams:
    """params.check(), its message naming the request's field (prefixed for nested objects)."""
    try:
        return params.check()
    except ValueError as e:
        raise ApiError(f.status, f.prefix + rename(str(e), names),
                       field=f.prefix + field_of(str(e), names)) from None  # fmt: skip


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
