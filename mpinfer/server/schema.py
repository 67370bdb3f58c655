"""The request bodies and responses of the HTTP API as JSON Schema, for /openapi.json: the routes
read their bodies themselves (api.py's errors name the field), so FastAPI cannot derive these.
Each generating route names its body with `openapi_extra={"x-mpinfer-body": NAME}`;
`describe(spec)` fills in the request body, the JSON and SSE responses and the error responses.
What is not here: the rules themselves (api.py, tgi.py, oai.py), which the tests check against
these schemas with generated requests.
"""

from __future__ import annotations

import json

from ..engine.sampling import MAX_STOP, MAX_TOP_N
from .oai import MAX_N

NUMBER = {"type": "number"}
STOP = {"anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1},
                   "maxItems": MAX_STOP}, {"type": "null"}]}  # fmt: skip
SAMPLING = {
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "typical_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 100},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
    "stop": STOP,
}
VLLM = {
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "user": {"type": "string"},
    "model": {"type": "string"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "additionalProperties": False, "properties": {
        "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "allowed_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "skip_special_tokens": {"type": "boolean"},
    "include_stop_str_in_output": {"type": "boolean"},
    "return_token_ids": {"type": "boolean"},
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_N},
}  # fmt: skip
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
BODIES = {
    "TgiRequest": {"type": "object", "required": ["inputs"], "additionalProperties": False,
                   "properties": {
        "inputs": {"type": "string", "minLength": 1},
        "stream": {"type": "boolean"},
        "parameters": {"type": "object", "additionalProperties": False, "properties": {
            **SAMPLING,
            "max_new_tokens": {"type": "integer", "minimum": 1},
            "do_sample": {"type": "boolean"},
            "details": {"type": "boolean"}, "return_full_text": {"type": "boolean"},
            "decoder_input_details": {"type": "boolean"},
            "truncate": {"type": "integer", "minimum": 1},
            "top_n_tokens": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_N},
            "best_of": {"type": "integer", "minimum": 1, "maximum": 8},
            "watermark": {"type": "boolean", "enum": [False]},
        }},
    }},
    "CompletionRequest": {"type": "object", "required": ["prompt"], "additionalProperties": False,
                          "properties": {
        **SAMPLING, **VLLM,
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1},
                              "minItems": 1}, TOKEN_IDS,
                             {"type": "array", "items": TOKEN_IDS, "minItems": 1}]},
        "max_tokens": {"type": "integer", "minimum": 0},
        "echo": {"type": "boolean"},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_N},
        "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "suffix": {"type": ["string", "null"], "maxLength": 0},
    }},
    "ChatRequest": {"type": "object", "required": ["messages"], "additionalProperties": False,
                    "properties": {
        **SAMPLING, **VLLM,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant"]},
                "name": {"type": "string"},
                "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                    "type": "object", "required": ["type", "text"],
                    "additionalProperties": False, "properties": {
                        "type": {"enum": ["text"]}, "text": {"type": "string"}}}}]},
            }}},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_N},
        "add_generation_prompt": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"},
    }},
}  # fmt: skip
BODIES["TokenizeRequest"] = {"type": "object", "additionalProperties": False, "properties": {
    "prompt": {"type": "string"}, "model": {"type": "string"},
    "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"},
    "messages": BODIES["ChatRequest"]["properties"]["messages"],
    "add_generation_prompt": {"type": "boolean"},
    "continue_final_message": {"type": "boolean"}}}  # fmt: skip
BODIES["DetokenizeRequest"] = {"type": "object", "additionalProperties": False, "properties": {
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "model": {"type": "string"}}}  # fmt: skip
ERROR = {"type": "object", "required": ["error"]}
RESPONSES = {
    "TgiRequest": {"type": "object", "required": ["generated_text"],
                   "properties": {"generated_text": {"type": "string"},
                                  "details": {"type": "object"}}},
    "CompletionRequest": {"type": "object", "required": ["id", "object", "choices", "usage"]},
    "ChatRequest": {"type": "object", "required": ["id", "object", "choices", "usage"]},
    "TokenizeRequest": {"type": "object", "required": ["tokens"]},
    "DetokenizeRequest": {"type": "object", "required": ["prompt"]},
}  # fmt: skip


def describe(spec: dict, *, max_seq_len: int, vocab_size: int | None) -> dict:
    """Fill each marked operation's request body and responses into an OpenAPI spec, with this
    server's limits (the longest generation a prompt of one token leaves room for, the
    vocabulary that token ids index; None while the model loads)."""
    limits = {"max_new_tokens": max_seq_len - 1, "max_tokens": max_seq_len - 1,
              "max_completion_tokens": max_seq_len - 1}  # fmt: skip
    for path in spec.get("paths", {}).values():
        for op in path.values():
            name = op.pop("x-mpinfer-body", None)
            if name is None:
                continue
            body = json.loads(json.dumps(BODIES[name]))  # a copy to put this server's limits in
            bound(body, limits, vocab_size)
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": body}}}  # fmt: skip
            op["responses"] = {
                "200": {"description": "the answer (JSON), or server-sent events when streaming",
                        "content": {"application/json": {"schema": RESPONSES[name]},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                **{str(code): {"description": why, "content": {"application/json": {
                    "schema": ERROR}}} for code, why in ERRORS.items()},
            }  # fmt: skip
    return spec


def bound(schema, limits: dict, vocab_size: int | None) -> None:
    """Set the maxima `limits` names on the properties of that name, and token ids' maximum."""
    if isinstance(schema, dict):
        for key, value in schema.get("properties", {}).items():
            if key in limits:
                value["maximum"] = limits[key]
        if schema.get("type") == "integer" and schema.get("minimum") == 0 and vocab_size and \
                "maximum" not in schema:  # fmt: skip
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            bound(value, limits, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound(value, limits, vocab_size)


ERRORS = {
    400: "a bad request (OpenAI routes), naming the field",
    401: "missing or wrong bearer token (server.api_key)",
    413: "the body is over server.max_body_bytes",
    415: "the body is not application/json",
    421: "the Host header does not name this server (bound to loopback)",
    422: "a bad request (TGI routes), naming the field",
    429: "the queue is full",
    500: "this request's generation failed (others go on)",
    503: "loading, draining, or a rank failed",
}
