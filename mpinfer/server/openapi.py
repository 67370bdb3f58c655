"""/openapi.json from the request models: the routes read their bodies themselves (so errors keep
each face's shape and name the field), so FastAPI does not see the models; each generating route
names its body with `openapi_extra={"x-mpinfer-body": NAME}`, and `describe(spec)` puts that
model's JSON Schema in (its nested models under components), with the answer's model and the
error model of the route's face, and this server's limits: the longest generation a one-token
prompt leaves room for, and the vocabulary token ids index. What is not here: the models (tgi.py,
oai.py, routes.py), which the fuzz test (tests/test_hardening.py) runs against this document.
"""

from __future__ import annotations

from .oai import BatchChatRequest, ChatRequest, CompletionRequest, CompletionResponse, OpenAIError
from .tgi import TgiError, TgiRequest, TgiResponse

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
REF = "#/components/schemas/{model}"


def describe(spec: dict, bodies: dict, *, max_seq_len: int, vocab_size: int | None) -> dict:
    """Fill each marked operation's request body and responses into an OpenAPI spec. `bodies`:
    NAME -> (request model, answer model, error model); the routes' faces add theirs."""
    faces = {"TgiRequest": (TgiRequest, TgiResponse, TgiError),
             "CompletionRequest": (CompletionRequest, CompletionResponse, OpenAIError),
             "ChatRequest": (ChatRequest, CompletionResponse, OpenAIError),
             "BatchChatRequest": (BatchChatRequest, CompletionResponse, OpenAIError),
             **bodies}  # fmt: skip
    limits = {"max_new_tokens": max_seq_len - 1, "max_tokens": max_seq_len - 1,
              "max_completion_tokens": max_seq_len - 1}  # fmt: skip
    components = spec.setdefault("components", {}).setdefault("schemas", {})

    def schema_of(model) -> dict:
        out = model.model_json_schema(ref_template=REF)
        for name, sub in out.pop("$defs", {}).items():
            components[name] = sub
        components[model.__name__] = out
        return {"$ref": REF.format(model=model.__name__)}

    for path in spec.get("paths", {}).values():
        for op in path.values():
            name = op.pop("x-mpinfer-body", None)
            if name is None:
                continue
            request, answer, error = faces[name]
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema_of(request)}},
            }
            op["responses"] = {
                "200": {"description": "the answer (JSON), or server-sent events when streaming",
                        "content": {"application/json": {"schema": schema_of(answer)},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                **{str(code): {"description": why, "content": {"application/json": {
                    "schema": schema_of(error)}}} for code, why in ERRORS.items()},
            }  # fmt: skip
    bound(components, limits, vocab_size)
    return spec


def bound(schema, limits: dict, vocab_size: int | None) -> None:
    """Set the maxima `limits` names on the properties of that name, and token ids' maximum
    (integers >= 0 without a maximum inside a list of token ids)."""
    if isinstance(schema, dict):
        for key, value in schema.get("properties", {}).items():
            if key in limits:
                for option in value.get("anyOf", [value]):
                    if option.get("type") == "integer":
                        option["maximum"] = limits[key]
        items = schema.get("items")
        if schema.get("type") == "array" and isinstance(items, dict) and vocab_size and \
                items.get("type") == "integer" and items.get("minimum") == 0:  # fmt: skip
            items["maximum"] = vocab_size - 1
        for value in schema.values():
            bound(value, limits, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound(value, limits, vocab_size)
