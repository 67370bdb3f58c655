"""What one client's request may cost the others or learn about them, on the suite's main
server (tiny model, fp32, 2 ranks): per-request limits on the fields whose work grows with
their size (a 400 naming each limit and its setting), that work done once per request rather
than every step, and vLLM's cache_salt keeping one client's cached prefixes from another's
guesses. The client-compatibility side of the same fields is test_vllm.py."""

from __future__ import annotations

import threading
import time

import httpx

from .test_openai import post
from .test_vllm import GREEDY


def test_what_one_request_may_ask_is_bounded_and_costs_others_nothing(server):
    """logit_bias entries, token-id lists and log-probabilities per answer have limits (a 400
    naming each, and the setting); repeated ids count once; a request at the limits (4096
    allowed ids, 1024 biases, 4096 stop ids held back by min_tokens) leaves another client's
    request within 2x its time alone (plus 0.25 s for a busy machine): the lists are tensors
    made once per request, not expanded every step."""

    def refused(body, key, words):
        r = httpx.post(server.url + "/v1/completions", json={**GREEDY, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text
        assert words in r.json()["error"]["message"], r.text

    refused(
        {"logit_bias": {str(i): 1 for i in range(1025)}},
        "logit_bias",
        "at most 1024 entries (server.max_logit_bias)",
    )
    refused(
        {"allowed_token_ids": [5] * 4097},
        "allowed_token_ids",
        "at most 4096 token ids (server.max_token_ids)",
    )
    ids = [(7 * i) % 900 + 20 for i in range(200)]  # 24 x 200 x (1 + 20) > the test server's
    refused(
        {"prompt": [ids] * 24, "echo": True, "logprobs": 20, "max_tokens": 0},
        "logprobs",
        "at most 98304 (server.max_logprob_entries)",
    )
    assert post(
        server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 5, "max_tokens": 0}
    )["choices"][0]["logprobs"]
    once = post(server, "/v1/completions", {**GREEDY, "allowed_token_ids": [5, 9, 77]})
    many = post(server, "/v1/completions", {**GREEDY, "allowed_token_ids": [5, 9, 77] * 900})
    assert once["choices"][0]["text"] == many["choices"][0]["text"]

    victim = {"inputs": "river", "parameters": {"max_new_tokens": 20}}

    def timed() -> float:
        t0 = time.perf_counter()
        assert httpx.post(server.url + "/generate", json=victim, timeout=60).status_code == 200
        return time.perf_counter() - t0

    alone = min(timed() for _ in range(3))
    heavy = {**GREEDY, "max_tokens": 200, "ignore_eos": True, "min_tokens": 200,
             "allowed_token_ids": list(range(20, 1000)) * 4,
             "stop_token_ids": list(range(3, 1000)),
             "logit_bias": {str(i): 0.5 for i in range(1024)}}  # fmt: skip
    attack = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions",
                                                        json=heavy, timeout=120))  # fmt: skip
    attack.start()
    time.sleep(0.3)
    beside = [timed() for _ in range(3)]
    attack.join()
    assert max(beside) < 2 * alone + 0.25, (alone, beside)


def test_cache_salt_keeps_one_clients_prefixes_from_another(server):
    """vLLM's cache_salt: a prompt another client sent (salted) shows no cache hit to a guess
    with another salt or none, and hits for the same salt; the answers are equal throughout."""
    prompt = [(11 * i) % 800 + 30 for i in range(70)]  # 4 full blocks of 16 and some
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}

    def hits(extra: dict) -> tuple[float, str]:
        before = server.metric("mpinfer_prefix_cache_hit_tokens_total")
        text = post(server, "/v1/completions", {**body, **extra})["choices"][0]["text"]
        return server.metric("mpinfer_prefix_cache_hit_tokens_total") - before, text

    first, text = hits({"cache_salt": "victim-key"})
    assert first == 0
    for guess in ({"cache_salt": "attacker"}, {}):
        got, same = hits(guess)
        assert got == 0 and same == text
    again, same = hits({"cache_salt": "victim-key"})
    assert again >= 64 and same == text
    r = httpx.post(server.url + "/v1/completions", json={**body, "cache_salt": ""}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
