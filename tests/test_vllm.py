"""Clients written for OpenAI's and vLLM's servers, unchanged: logit_bias, exact usage in every
mode, special tokens kept where they are text, and vLLM's request extensions with vLLM's meaning
(stop_token_ids, allowed_token_ids, min_p, skip_special_tokens, include_stop_str_in_output,
return_token_ids, return_tokens_as_token_ids, prompt_logprobs with ranks, truncate_prompt_tokens,
add_generation_prompt, continue_final_message, chat echo, custom roles, signed seeds, /version,
/tokenize with messages, `root` in /v1/models, /invocations, /load, /ping, the batched chat
route). Against the suite's server (tiny model, fp32, 2 ranks); the openai SDK where it
applies (vLLM's fields go in its extra_body)."""

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
    _, logp = oracle_logprobs(hf_model, ids)
    for j in range(1, len(ids)):
        assert abs(got[j][str(ids[j])]["logprob"] - want[j]) < 1e-4
        assert len(got[j]) >= 2  # the prompt token and its alternatives
        # its rank in the whole vocabulary: 1 + the tokens transformers finds more likely
        rank = 1 + int((logp[j - 1] > logp[j - 1, ids[j]] + 1e-5).sum())
        assert abs(got[j][str(ids[j])]["rank"] - rank) <= 1, (j, got[j], rank)
        best = max(got[j].values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1
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


def test_prompt_logprobs_beyond_the_servers_maximum_say_so_in_vllms_words(server):
    for n, asked in ((-1, "-1 (the whole vocabulary, "), (21, "21,")):
        r = httpx.post(server.url + "/v1/completions", json={**GREEDY, "prompt_logprobs": n},
                       timeout=30)  # fmt: skip
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and f"Requested prompt logprobs of {asked}" in message
        assert "which is greater than max allowed: 20" in message


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(server, client):
    """vLLM's return_tokens_as_token_ids: with logprobs every token, chosen or alternative, is
    `token_id:N` (N the id return_token_ids gives), plain and streamed, completions and chat;
    the log-probabilities and text offsets are those of the plain answer."""
    body = {**GREEDY, "logprobs": 2, "return_token_ids": True}
    plain = post(server, "/v1/completions", body)["choices"][0]
    named = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    named = named["choices"][0]
    ids = named["token_ids"]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    for top, plain_top, t in zip(named["logprobs"]["top_logprobs"],
                                 plain["logprobs"]["top_logprobs"], ids):  # fmt: skip
        assert f"token_id:{t}" in top and all(k.startswith("token_id:") for k in top)
        assert sorted(top.values()) == sorted(plain_top.values())
    stream = client.completions.create(model="m", prompt=GREEDY["prompt"], max_tokens=8,
                                       temperature=0, logprobs=1, stream=True,
                                       extra_body={"return_tokens_as_token_ids": True,
                                                   "return_token_ids": True})  # fmt: skip
    streamed = [(c.choices[0].logprobs.tokens, getattr(c.choices[0], "token_ids", None))
                for c in stream if c.choices and c.choices[0].logprobs]  # fmt: skip
    assert [tok for toks, _ in streamed for tok in toks] == [f"token_id:{t}" for t in ids]
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = chat.choices[0]
    content = choice.logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in choice.token_ids]
    assert all(a.token.startswith("token_id:") for c in content for a in c.top_logprobs)
    text = "".join(bytes(c.bytes).decode("utf-8", "replace") for c in content)
    assert text == choice.message.content  # bytes stay the text's


def test_chat_echo_returns_the_message_it_continues(server, client, tok):
    """vLLM's chat echo with continue_final_message: the answer is the assistant message sent
    followed by its continuation (plain and streamed alike), with the prompt's logprobs; echo
    after a user message adds nothing."""
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The river"}]
    body = {"messages": msgs, "max_tokens": 5, "temperature": 0,
            "continue_final_message": True, "add_generation_prompt": False}  # fmt: skip
    plain = post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True,
                                                   "return_token_ids": True})  # fmt: skip
    assert echoed["choices"][0]["message"]["content"] == "The river" + plain
    assert len(echoed["prompt_logprobs"]) == len(echoed["prompt_token_ids"])
    assert tok.decode(echoed["prompt_token_ids"]).endswith("The river")
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    stream = client.chat.completions.create(
        model="m", messages=msgs, max_tokens=5, temperature=0, stream=True, extra_body=extra
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "The river" + plain
    user_last = {"messages": msgs[:1], "max_tokens": 3, "temperature": 0}
    assert (post(server, "/v1/chat/completions", {**user_last, "echo": True})["choices"][0]
            == post(server, "/v1/chat/completions", user_last)["choices"][0])  # fmt: skip


def test_custom_roles_and_message_fields_reach_the_template(server):
    """A role other than the four, and fields beyond role/content/name, go to the template as
    vLLM passes them: the default template writes the role by its name; a bad role is a 400."""
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}]  # fmt: skip
    got = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                                "return_token_ids": True})  # fmt: skip
    rendered = post(server, "/tokenize", {"messages": msgs, "return_token_strs": True})
    assert got["prompt_token_ids"] == rendered["tokens"]
    assert "Tool: sunny\n" in "".join(rendered["token_strs"])
    for role in ("", "x" * 65):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": role, "content": "hi"}]})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"


def test_seeds_take_vllms_signed_range_and_errors_name_the_bound(server):
    body = {**GREEDY, "temperature": 1.0, "max_tokens": 6}
    a = post(server, "/v1/completions", {**body, "seed": -5})["choices"][0]["text"]
    # the same draw as TGI's unsigned seed 2**64 - 5 (the sampler's seed is taken modulo 2**64)
    tgi = post(
        server,
        "/generate",
        {
            "inputs": GREEDY["prompt"],
            "parameters": {
                "do_sample": True,
                "temperature": 1.0,
                "max_new_tokens": 6,
                "seed": 2**64 - 5,
            },
        },
    )
    assert a == tgi["generated_text"]
    for seed, kind in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        r = httpx.post(server.url + "/v1/completions", json={**body, "seed": seed}, timeout=30)
        assert r.status_code == 400 and kind in r.json()["error"]["message"], r.text


def test_out_of_vocabulary_prompt_ids_get_vllms_message(server):
    for prompt, bad in (([5, 99999, 7], 99999), ([5, -3], -3)):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                       timeout=30)  # fmt: skip
        assert r.status_code == 400, r.text
        assert f"Token id {bad} is out of vocabulary" in r.json()["error"]["message"]


def test_batch_chat_load_and_ping(server):
    """vLLM's /v1/chat/completions/batch: one choice per conversation, each the answer the chat
    route gives it alone, usage summed; streaming and n > 1 refused by name. GET /load (vLLM's
    server load) and /ping (SageMaker's health) answer."""
    convs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "bye"}],
    ]
    body = {"max_tokens": 4, "temperature": 0, "return_token_ids": True, "prompt_logprobs": 1}
    got = post(server, "/v1/chat/completions/batch", {**body, "messages": convs})
    assert [c["index"] for c in got["choices"]] == [0, 1]
    alone = [post(server, "/v1/chat/completions", {**body, "messages": c}) for c in convs]
    for choice, one in zip(got["choices"], alone):
        assert choice["message"] == one["choices"][0]["message"]
        assert choice["prompt_token_ids"] == one["prompt_token_ids"]
        assert len(choice["prompt_logprobs"]) == len(one["prompt_logprobs"])
    assert got["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    for bad, field in (
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [[]]}, "messages[0]"),
    ):
        r = httpx.post(server.url + "/v1/chat/completions/batch", timeout=30,
                       json={**body, "messages": convs, **bad})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").json() == {"status": "ready"}


def test_openapi_lists_the_vllm_fields_and_routes(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for model in ("CompletionRequest", "ChatRequest", "BatchChatRequest"):
        fields = schemas[model]["properties"]
        for name in ("return_tokens_as_token_ids", "prompt_logprobs", "truncate_prompt_tokens",
                     "truncation_side", "return_token_ids", "seed",
                     "logprob_token_ids"):  # fmt: skip
            assert name in fields, (model, name)
    assert "echo" in schemas["ChatRequest"]["properties"]
    assert schemas["BatchChatRequest"]["properties"]["messages"]["type"] == "array"
    for path in ("/v1/chat/completions/batch", "/invocations", "/load", "/ping"):
        assert path in spec["paths"], path


def test_logprob_token_ids_report_those_tokens_at_every_position(server, client, hf_model):
    """vLLM's logprob_token_ids: the alternatives at each generated position are exactly the
    named tokens, their log-probabilities transformers' at that position; plain, streamed and
    in chat; without logprobs, repeated or out of the vocabulary: a 400 naming the field."""
    wanted = [3, 17, 250]
    body = {**GREEDY, "logprobs": 1, "logprob_token_ids": wanted, "return_token_ids": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    choice = post(server, "/v1/completions", body)["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    _, logp = oracle_logprobs(hf_model, ids)
    start = len(choice["prompt_token_ids"])
    for j, (top, t) in enumerate(zip(choice["logprobs"]["top_logprobs"], choice["token_ids"])):
        assert set(top) == {f"token_id:{w}" for w in wanted} | {f"token_id:{t}"}
        for w in wanted:
            assert abs(top[f"token_id:{w}"] - float(logp[start + j - 1, w])) < 1e-4
    stream = client.completions.create(model="m", prompt=GREEDY["prompt"], max_tokens=8,
                                       temperature=0, logprobs=1, stream=True,
                                       extra_body={"logprob_token_ids": wanted,
                                                   "return_tokens_as_token_ids": True})  # fmt: skip
    tops = [t for c in stream if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.top_logprobs]  # fmt: skip
    assert tops == choice["logprobs"]["top_logprobs"]
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        extra_body={"logprob_token_ids": wanted, "return_tokens_as_token_ids": True},
    )
    for entry in chat.choices[0].logprobs.content:
        assert [a.token for a in entry.top_logprobs] == [f"token_id:{w}" for w in wanted]
    for bad in (
        {"logprobs": None},
        {"logprob_token_ids": [3, 3]},
        {"logprob_token_ids": [10**6]},
        {"logprob_token_ids": list(range(21))},
    ):
        r = httpx.post(server.url + "/v1/completions", json={**body, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text
