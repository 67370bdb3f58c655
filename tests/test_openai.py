"""The OpenAI routes complete, and TGI's details, against transformers on the same fp32 weights:
every prompt form, echo with log-probabilities (prompt scoring as lm-evaluation-harness asks
for it), n and best_of, stream usage, chat with the openai SDK and huggingface_hub, the OpenAPI
description, and the tokenizer routes."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from mpinfer.server.chat import load_chat_template

from .conftest import TINY

# fp32 on both sides, different reduction orders (tp 2 partial sums): log-probabilities agree to
# about 1e-5; 1e-4 leaves room and still catches an off-by-one position (errors of ~1).
TOL = 1e-4


@pytest.fixture(scope="module")
def tok(ckpts):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpts["st_sharded"])


def post(server, route, body, status=200):
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def oracle_logprobs(hf_model, ids):
    """transformers' log-probability of each token of `ids` given the ones before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
    logp = logits.log_softmax(-1)
    return [None] + [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)], logp


def test_every_prompt_form_becomes_its_own_choices(server, tok):
    one = post(server, "/v1/completions", {"prompt": "river king", "max_tokens": 5,
                                           "temperature": 0})["choices"][0]["text"]  # fmt: skip
    two = post(server, "/v1/completions", {"prompt": "the capital", "max_tokens": 5,
                                           "temperature": 0})["choices"][0]["text"]  # fmt: skip
    ids = [tok("river king").input_ids, tok("the capital").input_ids]
    for prompt in (["river king", "the capital"], ids):
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                             "n": 2})  # fmt: skip
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in r["choices"]] == [one, one, two, two]
        assert r["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
        assert r["usage"]["completion_tokens"] == 4 * 5
    single = post(server, "/v1/completions", {"prompt": ids[0], "max_tokens": 5,
                                              "temperature": 0})  # fmt: skip
    assert single["choices"][0]["text"] == one  # a list of token ids is one prompt
    assert (
        post(
            server, "/v1/completions", {"prompt": ["river king"], "max_tokens": 5, "temperature": 0}
        )["choices"][0]["text"]
        == one
    )


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_transformers_does(
    server, hf_model, tok
):
    ids = tok("the capital of france is paris, the river").input_ids
    r = post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 3,
                                         "max_tokens": 0, "temperature": 0})  # fmt: skip
    lp = r["choices"][0]["logprobs"]
    expected, logp = oracle_logprobs(hf_model, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids) and r["usage"]["completion_tokens"] == 0
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]),
                               torch.tensor(expected[1:]), atol=TOL, rtol=0)  # fmt: skip
    for i in range(1, len(ids)):  # the top 3 alternatives and the chosen token, as OpenAI
        best = logp[i - 1].topk(3)
        alternatives = lp["top_logprobs"][i]
        assert {tok.decode([j]) for j in best.indices.tolist()} <= set(alternatives)
        assert abs(max(alternatives.values()) - float(best.values[0])) < TOL
    assert r["choices"][0]["text"] == tok.decode(ids)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    # lm-evaluation-harness's request: max_tokens 1, logprobs 1; one generated token follows.
    r = post(
        server,
        "/v1/completions",
        {
            "prompt": [ids],
            "echo": True,
            "logprobs": 1,
            "max_tokens": 1,
            "temperature": 0,
            "seed": 1234,
        },
    )
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    greedy = int(logp[-1].argmax())
    assert lp["tokens"][-1] == tok.decode([greedy])
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())  # is_greedy holds


def test_n_best_of_and_seeds(server):
    body = {"prompt": "river", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    a = post(server, "/v1/completions", {**body, "n": 3})["choices"]
    b = post(server, "/v1/completions", {**body, "n": 3})["choices"]
    assert [c["text"] for c in a] == [c["text"] for c in b]  # seeded: reproducible
    assert len({c["text"] for c in a}) > 1  # each choice its own seed
    r = post(server, "/v1/completions", {**body, "n": 1, "best_of": 3, "logprobs": 0})
    assert len(r["choices"]) == 1 and r["usage"]["completion_tokens"] == 3 * 8
    best = r["choices"][0]["logprobs"]["token_logprobs"]
    means = [sum(c) / len(c) for c in ([c["logprobs"]["token_logprobs"] for c in post(
        server, "/v1/completions", {**body, "n": 3, "logprobs": 0})["choices"]])]  # fmt: skip
    assert abs(sum(best) / len(best) - max(means)) < 1e-6  # the most likely per token


def test_streams_end_with_a_usage_chunk_when_asked(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model="m", prompt=["river", "king"], max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        text[c.choices[0].index] += c.choices[0].text
    for i, p in enumerate(["river", "king"]):
        plain = client.completions.create(model="m", prompt=p, max_tokens=6, temperature=0)
        assert text[i] == plain.choices[0].text
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
        stream=True, stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ))  # fmt: skip
    assert all(c.usage is not None for c in chunks)  # continuous_usage_stats: in every chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_chat_with_the_openai_sdk_is_the_templated_completion(server, tok):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You answer."},
                {"role": "user", "content": "the capital of france"}]  # fmt: skip
    prompt = load_chat_template("/nonexistent").render(messages)
    assert prompt == "You answer.\n\nUser: the capital of france\nAssistant:"
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert chat.usage.prompt_tokens == len(tok(prompt).input_ids)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                            temperature=0, stream=True)  # fmt: skip
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == plain.choices[0].text
    parts = [{"role": "user", "content": [{"type": "text", "text": "the capital "},
                                          {"type": "text", "text": "of france"}]}]  # fmt: skip
    two = client.chat.completions.create(model="m", messages=[messages[0], *parts],
                                         max_tokens=8, temperature=0, n=2)  # fmt: skip
    assert [c.message.content for c in two.choices] == [plain.choices[0].text] * 2


def test_huggingface_hub_chat_completion(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.url, timeout=60)
    out = client.chat_completion([{"role": "user", "content": "hello"}], max_tokens=6, seed=5)
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat_completion(
        [{"role": "user", "content": "hello"}], max_tokens=6, seed=5, stream=True))  # fmt: skip
    assert streamed == out.choices[0].message.content


def test_tgi_details_prefill_top_tokens_and_best_of(server, hf_model, tok):
    ids = tok("river king queen water").input_ids
    r = post(server, "/generate", {"inputs": "river king queen water", "parameters": {
        "max_new_tokens": 4, "decoder_input_details": True, "top_n_tokens": 2,
        "details": True}})  # fmt: skip
    d = r["details"]
    expected, _ = oracle_logprobs(hf_model, ids)
    assert [p["id"] for p in d["prefill"]] == ids and d["prefill"][0]["logprob"] is None
    torch.testing.assert_close(torch.tensor([p["logprob"] for p in d["prefill"][1:]]),
                               torch.tensor(expected[1:]), atol=TOL, rtol=0)  # fmt: skip
    assert len(d["top_tokens"]) == 4 and all(len(t) == 2 for t in d["top_tokens"])
    assert all(t["id"] == top[0]["id"] for t, top in zip(d["tokens"], d["top_tokens"]))
    # The final text is the tokenizer's decode of the generated ids.
    assert r["generated_text"] == tok.decode([t["id"] for t in d["tokens"]])
    r = post(
        server,
        "/generate",
        {
            "inputs": "river",
            "parameters": {
                "max_new_tokens": 6,
                "best_of": 3,
                "do_sample": True,
                "seed": 3,
                "details": True,
            },
        },
    )
    others = r["details"]["best_of_sequences"]
    assert len(others) == 2
    best = sum(t["logprob"] for t in r["details"]["tokens"])
    assert all(best >= sum(t["logprob"] for t in o["tokens"]) for o in others)


def test_openapi_describes_every_request_body_and_its_errors(server):
    """Generated from the request models: each body a closed object with its required fields,
    this server's limits on the lengths and token ids, and every error status in its face's
    shape."""
    spec = httpx.get(server.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def resolve(ref: dict) -> dict:
        return schemas[ref["$ref"].rsplit("/", 1)[1]]

    for path, required, error in (
        ("/generate", "inputs", "error_type"), ("/generate_stream", "inputs", "error_type"),
        ("/", "inputs", "error_type"), ("/v1/completions", "prompt", "error"),
        ("/v1/chat/completions", "messages", "error"), ("/tokenize", None, "error"),
    ):  # fmt: skip
        op = spec["paths"][path]["post"]
        schema = resolve(op["requestBody"]["content"]["application/json"]["schema"])
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert required is None or required in schema["required"]
        assert {"200", "400", "422", "429", "503"} <= set(op["responses"])
        assert "text/event-stream" in op["responses"]["200"]["content"]
        err = resolve(op["responses"]["422"]["content"]["application/json"]["schema"])
        assert error in err["properties"]
    info = httpx.get(server.url + "/info").json()
    tgi = schemas["TgiParameters"]["properties"]
    limit = [o for o in tgi["max_new_tokens"]["anyOf"] if o.get("type") == "integer"][0]
    assert limit["maximum"] == info["max_seq_len"] - 1
    ids = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert ids["maximum"] == TINY["vocab"] - 1


def test_tokenizer_routes_round_trip(server, tok):
    text = "café 東京 river"
    r = post(server, "/tokenize", {"prompt": text})
    assert r["tokens"] == tok(text).input_ids
    assert post(server, "/detokenize", {"tokens": r["tokens"]})["prompt"] == text
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>"
    assert (
        post(server, "/detokenize", {"tokens": [10**9]}, status=400)["error"]["param"] == "tokens"
    )


def test_info_gives_the_generation_defaults(server):
    info = httpx.get(server.url + "/info").json()
    assert info["generation_defaults"]["max_new_tokens"] == 32
    # The OpenAI route takes the same default (not OpenAI's 16); vLLM's ignore_eos holds it.
    r = post(server, "/v1/completions", {"prompt": "river", "temperature": 0, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == 32 and r["choices"][0]["finish_reason"] == "length"


def test_chat_templates_default_checkpoint_and_configured(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "bye"}]  # fmt: skip
    assert (
        load_chat_template(str(d)).render(messages) == "User: hi\nAssistant: yo\nUser: bye\n"
        "Assistant:"
    )
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "chat_template": "{% for m in messages %}<{{ m.role }}>"
        "{{ m.content }}{{ eos_token }}{% endfor %}"}))  # fmt: skip
    assert (
        load_chat_template(str(d)).render(messages) == "<user>hi</s><assistant>yo</s><user>bye</s>"
    )
    custom = tmp_path / "t.jinja"
    custom.write_text("{{ messages[-1].content | upper }}")
    assert load_chat_template(str(d), str(custom)).render(messages) == "BYE"
    custom.write_text("{% for m in messages %}{{ m.content ")
    with pytest.raises(ValueError, match="t.jinja does not render"):
        load_chat_template(str(d), str(custom))
    custom.write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="no system role"):
        load_chat_template(str(d), str(custom))
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(d), str(tmp_path / "missing.jinja"))
    assert load_chat_template(str(tmp_path)).origin == "mpinfer's default for BLOOM"


@pytest.mark.parametrize("body, limit", [
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}", "output budget"),
    ("{{ 'ab' * 3000000 }}", "past its budget"),
    ("{{ 2 ** 5000 }}", "above its budget"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "1 s budget"),
])  # fmt: skip
def test_each_of_a_chat_templates_limits_is_a_budget_error(tmp_path, body, limit):
    """Each limit of a render (the output cap, a multiplied sequence, a power, the clock) is
    a TemplateOverBudget naming its budget, reached by a template that passes the start-up
    check and goes over on a 5-message chat; whichever a machine reaches first, the message
    names the budget (the HTTP test of this relies on that)."""
    from mpinfer.server.chat import ChatTemplate, TemplateOverBudget

    t = ChatTemplate("{% if messages|length > 4 %}" + body + "{% endif %}", origin="test")
    t0 = time.perf_counter()
    with pytest.raises(TemplateOverBudget, match="budget") as e:
        t.render([{"role": "user", "content": "hi"}] * 5)
    assert limit in str(e.value) and time.perf_counter() - t0 < 5


@pytest.mark.parametrize("status", ["loading", "stopping"])
def test_generation_routes_answer_503_until_the_engine_is_attached(status):
    """No engine, no tokenizer, no chat template: every generation route says the server is not
    ready (a 503 a client retries), before it parses a body that would need them."""
    from fastapi.testclient import TestClient

    from mpinfer.config import load_config
    from mpinfer.server.routes import build_app
    from mpinfer.server.streams import State

    state = State(load_config(overrides=["model.path=unused"]), model_name="m")
    state.status = status
    client = TestClient(build_app(state), base_url="http://127.0.0.1:8080")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for route, body in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "a"}),
                        ("/generate", {"inputs": "a"}), ("/generate_stream", {"inputs": "a"}),
                        ("/tokenize", {"prompt": "a"})]:  # fmt: skip
        r = client.post(route, json=body)
        assert r.status_code == 503, (route, r.text)
        assert status in r.text or "loading" in r.text, (route, r.text)
    assert client.get("/health").status_code == 503


def test_request_models_name_the_field_as_the_request_wrote_it():
    """pydantic's errors become the face's: the path into the body (list indices, nested
    objects; a union's branch names left out), what was wrong and what was sent; a null is an
    absent field; a boolean is not an integer, an infinite number is not a number."""
    from mpinfer.server.api import ApiError, validate
    from mpinfer.server.oai import ChatRequest, CompletionRequest
    from mpinfer.server.tgi import TgiRequest

    def error(model, body) -> str:
        with pytest.raises(ApiError) as e:
            validate(model, body, 422)
        assert e.value.status == 422 and e.value.message.startswith(e.value.field)
        return e.value.message

    image = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert error(ChatRequest, image).startswith("messages[0].content[0].type: ")
    assert error(ChatRequest, {"messages": [{"role": 5}]}).startswith("messages[0].role")
    assert error(TgiRequest, {"inputs": "x", "parameters": {"top_k": "3"}}) == (
        "parameters.top_k: input should be a valid integer, got string"
    )
    assert error(TgiRequest, {"inputs": "x", "colour": 1}) == "colour: unknown field"
    assert error(TgiRequest, {"inputs": "x", "parameters": {"max_new_tokens": True}}).startswith(
        "parameters.max_new_tokens: input should be a valid integer"
    )
    assert error(TgiRequest, {"inputs": "x", "parameters": {"temperature": float("inf")}}
                 ).startswith("parameters.temperature: ")  # fmt: skip
    assert error(CompletionRequest, {"prompt": "x", "n": 17}).startswith(
        "n: input should be less than or equal"
    )
    r = validate(TgiRequest, {"inputs": "x", "parameters": None, "stream": None}, 422)
    assert r.parameters.best_of == 1 and r.stream is False
    r = validate(CompletionRequest, {"prompt": [[1, 2], [3]], "max_tokens": 4}, 400)
    assert r.prompt == [[1, 2], [3]] and r.max_tokens == 4
