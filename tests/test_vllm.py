"""Clients written for OpenAI's and vLLM's servers, unchanged: logit_bias, exact usage in every
mode, special tokens kept where they are text, and vLLM's request extensions with vLLM's meaning
(stop_token_ids, allowed_token_ids, min_p, skip_special_tokens, include_stop_str_in_output,
return_token_ids, prompt_logprobs, add_generation_prompt, continue_final_message, /version,
/tokenize with messages, `root` in /v1/models). Against the suite's server (tiny model, fp32, 2
ranks); the openai SDK where it applies (vLLM's fields go in its extra_body)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from openai import OpenAI

from .test_openai import oracle_logprobs, post
from .test_openai import tok as tok  # a fixture, used by name

GREEDY = {"prompt": "the river and the king", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused")


def tokens(server, body) -> list[int]:
    choice = post(server, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
    return choice["token_ids"]


def test_logit_bias_forces_and_bans_tokens_and_is_batch_independent(server, client):
    base = tokens(server, GREEDY)
    forced = client.completions.create(model="m", prompt=GREEDY["prompt"], max_tokens=4,
                                       temperature=0, logit_bias={"77": 100},
                                       extra_body={"return_token_ids": True})  # fmt: skip
    assert forced.choices[0].model_extra["token_ids"] == [77] * 4
    banned = tokens(server, {**GREEDY, "logit_bias": {str(base[0]): -100}})
    assert banned[0] != base[0]
    # The same biased request alone and beside three others: the same tokens.
    body = {**GREEDY, "logit_bias": {str(base[1]): -100, "5": 3.5}}
    alone, beside = tokens(server, body), {}

    def other(i):
        beside[i] = tokens(server, {**GREEDY, "prompt": f"other {i}"} if i else body)

    threads = [threading.Thread(target=other, args=(i,)) for i in range(4)]
    [t.start() for t in threads], [t.join() for t in threads]
    assert beside[0] == alone
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={**GREEDY, "logit_bias": {"abc": 1, "99999999": 2, "3": 1}})  # fmt: skip
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "'abc'" in message and "'99999999'" in message and "logit_bias" in message
    r = httpx.post(server.url + "/v1/completions", json={**GREEDY, "logit_bias": {"3": 101}})
    assert r.status_code == 400 and "[-100, 100]" in r.json()["error"]["message"]


def test_allowed_stop_token_ids_and_min_p(server):
    allowed = tokens(server, {**GREEDY, "allowed_token_ids": [11, 12, 13]})
    assert set(allowed) <= {11, 12, 13} and len(allowed) == 8
    base = tokens(server, GREEDY)
    first = next(i for i, t in enumerate(base) if t not in base[:i])  # a token's first place
    stop_at = base[2] if base[2] not in base[:2] else base[first]
    out = post(server, "/v1/completions", {**GREEDY, "stop_token_ids": [stop_at],
                                           "return_token_ids": True})["choices"][0]  # fmt: skip
    assert out["token_ids"] == base[: base.index(stop_at) + 1]
    assert out["finish_reason"] == "stop"
    # min_p 1: only the most likely token survives, so sampling equals greedy.
    assert tokens(server, {**GREEDY, "temperature": 1.3, "seed": 4, "min_p": 1.0}) == base
    r = httpx.post(server.url + "/v1/completions", json={**GREEDY, "stop_token_ids": [10**9]})
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]


def test_usage_is_exact_in_every_mode(server):
    body = {"prompt": "the river", "max_tokens": 3, "n": 4, "temperature": 1, "seed": 1}
    plain = post(server, "/v1/completions", body)["usage"]
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:  # fmt: skip
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert (
        chunks[-1]["usage"]
        == plain
        == {
            "prompt_tokens": plain["prompt_tokens"],
            "completion_tokens": 12,
            "total_tokens": plain["prompt_tokens"] + 12,
        }
    )
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            **body, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}) as r:  # fmt: skip
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks and not any("usage" in c for c in chunks)


def test_special_tokens_are_text_in_echo_and_when_asked(server):
    """<s> and </s> in an echoed, scored prompt are there in the text and the logprob tokens;
    generated </s> shows with skip_special_tokens false and not by default."""
    out = post(server, "/v1/completions", {"prompt": [1, 300, 301, 2, 302], "max_tokens": 0,
                                           "echo": True, "logprobs": 0})["choices"][0]  # fmt: skip
    assert out["text"].startswith("<s>") and "</s>" in out["text"]
    assert out["logprobs"]["tokens"][0] == "<s>" and out["logprobs"]["tokens"][3] == "</s>"
    body = {**GREEDY, "max_tokens": 3, "allowed_token_ids": [2], "ignore_eos": True}
    shown = post(server, "/v1/completions", {**body, "skip_special_tokens": False})
    assert shown["choices"][0]["text"] == "</s>" * 3
    assert post(server, "/v1/completions", body)["choices"][0]["text"] == ""


def test_include_stop_str_in_output(server):
    text = post(server, "/v1/completions", GREEDY)["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = post(server, "/v1/completions", {**GREEDY, "stop": [stop]})["choices"][0]["text"]
    kept = post(
        server, "/v1/completions", {**GREEDY, "stop": [stop], "include_stop_str_in_output": True}
    )["choices"][0]
    assert kept["text"] == cut + stop and kept["finish_reason"] == "stop"


def test_prompt_logprobs_equal_transformers(server, hf_model, tok):
    ids = tok("the river and the king of the city", add_special_tokens=False)["input_ids"]
    want, _ = oracle_logprobs(hf_model, ids)
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2,
                                           "return_token_ids": True})["choices"][0]  # fmt: skip
    got = out["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) == len(out["prompt_token_ids"])
    for j in range(1, len(ids)):
        assert abs(got[j][str(ids[j])]["logprob"] - want[j]) < 1e-4
        assert len(got[j]) >= 2  # the prompt token and its alternatives
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1, "prompt_logprobs": 0,
                                                 "return_token_ids": True})  # fmt: skip
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    r = httpx.post(server.url + "/v1/completions", json={**GREEDY, "prompt_logprobs": 1,
                                                         "stream": True})  # fmt: skip
    assert r.status_code == 400 and "prompt_logprobs" in r.text


def test_chat_prompt_controls_tokenize_version_and_models(server):
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The river"}]
    with_prompt = post(server, "/tokenize", {"messages": msgs[:1], "return_token_strs": True})
    without = post(server, "/tokenize", {"messages": msgs[:1], "add_generation_prompt": False})
    assert without["tokens"] == with_prompt["tokens"][: len(without["tokens"])]
    assert len(with_prompt["tokens"]) > len(without["tokens"])
    assert "".join(with_prompt["token_strs"]).endswith("Assistant:")
    cont = post(
        server,
        "/tokenize",
        {
            "messages": msgs,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "return_token_strs": True,
        },
    )
    assert "".join(cont["token_strs"]).endswith("The river")
    out = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                "continue_final_message": True,
                                                "add_generation_prompt": False,
                                                "return_token_ids": True})  # fmt: skip
    assert out["prompt_token_ids"] == cont["tokens"]
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": msgs[:1], "continue_final_message": True, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and "assistant message last" in r.text
    assert httpx.get(server.url + "/version").json()["version"]
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert model["root"] == model["id"]


def test_truncate_prompt_tokens_keeps_the_prompts_end_or_start(server, tok):
    """vLLM's truncate_prompt_tokens (with truncation_side): the prompt's last N tokens (or its
    first N), for text and token-id prompts, and -1 as many as max_seq_len leaves beside
    max_tokens; 0 and a side alone are refused by name."""
    text = "the river and the king of the city walked past the old stone bridge"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 6
    base = {"prompt": text, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    r = post(server, "/v1/completions", {**base, "truncate_prompt_tokens": 5})
    assert r["choices"][0]["prompt_token_ids"] == ids[-5:] and r["usage"]["prompt_tokens"] == 5
    r = post(server, "/v1/completions", {**base, "truncate_prompt_tokens": 5,
                                         "truncation_side": "right"})  # fmt: skip
    assert r["choices"][0]["prompt_token_ids"] == ids[:5]
    r = post(server, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": 3})
    assert r["choices"][0]["prompt_token_ids"] == ids[-3:]
    r = post(server, "/v1/completions", {**base, "truncate_prompt_tokens": -1})
    assert r["choices"][0]["prompt_token_ids"] == ids  # it fits: nothing cut
    for bad, field in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                       ({"truncation_side": "left"}, "truncation_side"),
                       ({"truncate_prompt_tokens": 2, "truncation_side": "middle"},
                        "truncation_side")):  # fmt: skip
        got = httpx.post(server.url + "/v1/completions", json={**base, **bad}, timeout=30)
        assert got.status_code == 400 and field in got.json()["error"]["message"], got.text


def test_invocations_is_completions_or_chat_by_its_body(server):
    """SageMaker's POST /invocations, as vLLM serves it: `messages` makes it a chat completion,
    else a completion; the same answers as the routes themselves."""
    done = post(server, "/invocations", GREEDY)
    assert done["object"] == "text_completion"
    same = post(server, "/v1/completions", GREEDY)
    assert done["choices"][0]["text"] == same["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    got = post(server, "/invocations", chat)
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == post(server, "/v1/chat/completions",
                                                chat)["choices"][0]["message"]  # fmt: skip
    r = httpx.post(server.url + "/invocations", content=b"[1", timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()
