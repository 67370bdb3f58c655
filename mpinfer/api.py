"""Request parsing for the HTTP API: raw body -> (prompt, SamplingParams), or an `ApiError`
naming the field. TGI routes answer 422 for bad input, OpenAI routes 400; both formats of error
body are built here. No FastAPI in this module, so every rule is testable on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .sampling import MAX_STOP, SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, field: str = "", kind: str = "validation"):
        super().__init__(message)
        self.status, self.message, self.field, self.kind = status, message, field, kind


@dataclass(frozen=True)
class Parsed:
    prompt: str
    params: SamplingParams
    stream: bool = False
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False
    truncate: int | None = None
    echo: bool = False


def read_json(body: bytes, status: int) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(status, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(status, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(status, "request body must be a JSON object")
    return data


class Fields:
    """Typed getters over one JSON object; every error names the field (with its prefix)."""

    def __init__(self, data: dict, status: int, prefix: str = ""):
        self.data, self.status, self.prefix = data, status, prefix

    def _fail(self, key: str, msg: str):
        raise ApiError(self.status, f"{self.prefix}{key}: {msg}", field=self.prefix + key)

    def get(self, key: str, kind: str, default: Any = None) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
        }[kind]
        if not ok:
            self._fail(key, f"expected {kind}, got {type(value).__name__}")
        if kind == "float":
            value = float(value)
            if not math.isfinite(value):
                self._fail(key, f"must be a finite number, got {value}")
        return value

    def stop_list(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            self._fail(key, "expected a string or a list of strings")
        if len(value) > MAX_STOP:
            self._fail(key, f"at most {MAX_STOP} stop strings, got {len(value)}")
        if any(not s for s in value):
            self._fail(key, "stop strings must not be empty")
        return tuple(value)

    def reject_unknown(self, known: set[str]) -> None:
        for key in self.data:
            if key not in known:
                self._fail(key, "unknown field")


def _params(f: Fields, *, max_new_key: str, default_max_new: int, sample_default: bool,
            stop_key: str) -> SamplingParams:  # fmt: skip
    temperature = f.get("temperature", "float")
    top_k, top_p = f.get("top_k", "int"), f.get("top_p", "float")
    typical_p = f.get("typical_p", "float")
    do_sample = f.get("do_sample", "bool")
    if do_sample is None:  # sampling when asked for, or when any sampling control is given
        do_sample = sample_default or any(v is not None for v in (top_k, top_p, typical_p))
        if temperature is not None:
            do_sample = temperature > 0
    if temperature is not None and temperature < 0:
        f._fail("temperature", f"must be >= 0, got {temperature}")
    max_new = f.get(max_new_key, "int", default_max_new)
    params = SamplingParams(
        max_new_tokens=max_new,
        do_sample=do_sample and temperature != 0,
        temperature=1.0 if temperature in (None, 0) else temperature,
        top_k=0 if top_k is None else top_k,
        top_p=1.0 if top_p is None else top_p,
        typical_p=1.0 if typical_p is None else typical_p,
        repetition_penalty=f.get("repetition_penalty", "float", 1.0),
        seed=f.get("seed", "int"),
        stop=f.stop_list(stop_key),
    )
    try:
        params.check()
    except ValueError as e:  # SamplingParams names the field: prefix it for nested objects
        key = str(e).split("=", 1)[0].split(":", 1)[0]
        raise ApiError(f.status, f"{f.prefix}{e}", field=f.prefix + key) from None
    return params


TGI_PARAMS = {
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "stop", "seed", "details", "return_full_text", "truncate",
    "decoder_input_details", "best_of", "watermark", "frequency_penalty", "top_n_tokens",
    "grammar", "adapter_id",
}  # fmt: skip


def parse_tgi(body: bytes, *, default_max_new: int, stream: bool | None = None) -> Parsed:
    data = read_json(body, 422)
    top = Fields(data, 422)
    top.reject_unknown({"inputs", "parameters", "stream"})
    prompt = top.get("inputs", "str")
    if not prompt:
        top._fail("inputs", "must be a non-empty string")
    raw = data.get("parameters") or {}
    if not isinstance(raw, dict):
        top._fail("parameters", "must be an object")
    f = Fields(raw, 422, "parameters.")
    f.reject_unknown(TGI_PARAMS)
    if (f.get("best_of", "int") or 1) > 1:
        f._fail("best_of", "values above 1 are not supported")
    if f.get("watermark", "bool"):
        f._fail("watermark", "is not supported")
    for key in ("grammar", "adapter_id"):
        if raw.get(key) is not None:
            f._fail(key, "is not supported")
    if f.get("top_n_tokens", "int"):
        f._fail("top_n_tokens", "is not supported")
    if raw.get("frequency_penalty") not in (None, 0, 0.0):
        f._fail("frequency_penalty", "is not supported; use repetition_penalty")
    truncate = f.get("truncate", "int")
    if truncate is not None and truncate <= 0:
        f._fail("truncate", f"must be > 0, got {truncate}")
    params = _params(f, max_new_key="max_new_tokens", default_max_new=default_max_new,
                     sample_default=False, stop_key="stop")  # fmt: skip
    return Parsed(
        prompt, params,
        stream=stream if stream is not None else bool(top.get("stream", "bool", False)),
        details=bool(f.get("details", "bool", False)),
        return_full_text=bool(f.get("return_full_text", "bool", False)),
        decoder_input_details=bool(f.get("decoder_input_details", "bool", False)),
        truncate=truncate,
    )  # fmt: skip


OPENAI_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
    "echo", "logprobs", "user", "presence_penalty", "frequency_penalty", "best_of",
    "stream_options", "top_k", "repetition_penalty", "typical_p", "logit_bias", "suffix",
}  # fmt: skip


def parse_openai(body: bytes, *, default_max_new: int = 16) -> Parsed:
    data = read_json(body, 400)
    f = Fields(data, 400)
    f.reject_unknown(OPENAI_FIELDS)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        f._fail("prompt", "a list of several prompts is not supported; send one string")
    prompt = f.get("prompt", "str")
    if not prompt:
        f._fail("prompt", "must be a non-empty string")
    if (f.get("n", "int") or 1) != 1:
        f._fail("n", "only n=1 is supported")
    if (f.get("best_of", "int") or 1) != 1:
        f._fail("best_of", "only best_of=1 is supported")
    for key in ("presence_penalty", "frequency_penalty"):
        if f.get(key, "float") not in (None, 0.0):
            f._fail(key, "is not supported; use repetition_penalty")
    if data.get("logit_bias"):
        f._fail("logit_bias", "is not supported")
    if data.get("suffix"):
        f._fail("suffix", "is not supported")
    if f.get("logprobs", "int"):
        f._fail("logprobs", "is not supported")
    params = _params(f, max_new_key="max_tokens", default_max_new=default_max_new,
                     sample_default=True, stop_key="stop")  # fmt: skip
    return Parsed(prompt, params, stream=bool(f.get("stream", "bool", False)),
                  echo=bool(f.get("echo", "bool", False)))  # fmt: skip


def tgi_error(e: ApiError) -> dict:
    return {"error": e.message, "error_type": e.kind, "field": e.field}


def openai_error(e: ApiError) -> dict:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.field or None, "code": None}}
