"""The HTTP server as real processes: `mpinfer serve --nproc 2` (and torchrun), the tiny model,
127.0.0.1 on a free port. Clients: the official `openai` client, Hugging Face's
`text-generation` client and InferenceClient, httpx. Bad and hostile input, limits, a drain.
What is not here: how ranks live and die (test_lifetime.py), the hostile-client probes
(test_guard.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from .conftest import Server

PROMPTS = ["the capital of france is", "river king queen", "café 東京 water", "a"]
MAX_NEW = 10


@pytest.fixture(scope="module")
def reference(ckpts):
    """launch/generate.py's greedy texts for PROMPTS (same checkpoint, quant, dtype)."""
    from .conftest import torchrun

    args = [
        "launch/generate.py",
        "--model",
        str(ckpts["st_sharded"]),
        "--quant",
        "none",
        "--dtype",
        "float32",
        "--greedy",
        "--json",
        "--max-new-tokens",
        str(MAX_NEW),
    ]
    for p in PROMPTS:
        args += ["--prompt", p]
    proc = torchrun(2, args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {r["prompt"]: r["text"] for r in map(json.loads, proc.stdout.splitlines())}


def test_openai_client_matches_generate(server, reference):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        r = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == reference[prompt]
        assert r.choices[0].finish_reason in ("length", "stop")
        stream = client.completions.create(
            model="m", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == reference[prompt]
    assert [m.id for m in client.models.list()] == ["st_sharded"]


def test_text_generation_client_matches_generate(server, reference):
    from text_generation import Client

    client = Client(server.url, timeout=60)
    for prompt in PROMPTS:
        r = client.generate(prompt, max_new_tokens=MAX_NEW)
        assert r.generated_text == reference[prompt]
        assert len(r.details.tokens) == r.details.generated_tokens
        events = list(client.generate_stream(prompt, max_new_tokens=MAX_NEW))
        assert "".join(e.token.text for e in events) == reference[prompt]
        assert events[-1].generated_text == reference[prompt]


def test_huggingface_hub_inference_client_matches_generate(server, reference):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.url, timeout=60)
    for prompt in PROMPTS[:2]:
        assert client.text_generation(prompt, max_new_tokens=MAX_NEW) == reference[prompt]
        streamed = client.text_generation(prompt, max_new_tokens=MAX_NEW, stream=True)
        assert "".join(streamed) == reference[prompt]


BAD = [
    # (route, body, status, words the message must contain)
    ("/generate", b'{"inputs": ""}', 422, "inputs"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": 0}}', 422, "max_new_tokens"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": 999}}', 422,
     "max_new_tokens"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": 1e30}}', 422,
     "max_new_tokens"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": 100000000000000000000}}',
     422, "max_new_tokens"),
    ("/generate", b'{"inputs": "hi", "parameters": {"temperature": -1}}', 422, "temperature"),
    ("/generate", b'{"inputs": "hi", "parameters": {"temperature": NaN}}', 422, "temperature"),
    ("/generate", b'{"inputs": "hi", "parameters": {"temperature": 1e999}}', 422, "temperature"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_p": 1.5}}', 422, "top_p"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_p": 0}}', 422, "top_p"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_k": -3}}', 422, "top_k"),
    ("/generate", b'{"inputs": "hi", "parameters": {"typical_p": 0}}', 422, "typical_p"),
    ("/generate", b'{"inputs": "hi", "parameters": {"do_sample": true, '
     b'"repetition_penalty": 1e-300}}', 422, "repetition_penalty"),
    ("/generate", b'{"inputs": "hi", "parameters": {"do_sample": true, '
     b'"repetition_penalty": 5e-324}}', 422, "repetition_penalty"),
    ("/generate", b'{"inputs": "hi", "parameters": {"repetition_penalty": 0}}', 422,
     "repetition_penalty"),
    ("/generate", b'{"inputs": "hi", "parameters": {"do_sample": true, '
     b'"seed": 18446744073709551616}}', 422, "seed"),
    ("/generate", b'{"inputs": "hi", "parameters": {"seed": -1}}', 422, "seed"),
    ("/generate", b'{"inputs": "hi", "parameters": {"stop": ["a","b","c","d","e","f","g","h",'
     b'"i"]}}', 422, "stop"),
    ("/generate", b'{"inputs": "hi", "parameters": {"stop": [""]}}', 422, "stop"),
    ("/generate", b'{"inputs": "hi", "parameters": {"stop": [1]}}', 422, "stop"),
    ("/generate", b'{"inputs": "hi", "parameters": {"max_new_tokens": "5"}}', 422,
     "max_new_tokens"),
    ("/generate", b'{"inputs": 5}', 422, "inputs"),
    ("/generate", b'{"inputs": "\\ud800abc"}', 422, "inputs: invalid Unicode"),
    ("/generate", b'{"inputs": "hi", "parameters": {"stop": ["\\udfff"]}}', 422,
     "parameters.stop[0]: invalid Unicode"),
    ("/generate", b'{"inputs": "hi", "parameters": {"\\ud800": 1}}', 422,
     "parameters: a key: invalid Unicode"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"9" * 5000 + b"}", 400,
     "a number too large to read"),
    ("/generate", b'{"inputs": "hi", "stream": {}}', 422, "stream"),
    ("/generate", b'{"inputs": "hi", "parameters": []}', 422, "parameters"),
    ("/generate", b'{"inputs": "hi", "parameters": {"best_of": 2}}', 422, "best_of"),
    ("/generate", b'{"inputs": "hi", "parameters": {"colour": 1}}', 422, "colour"),
    ("/generate", b'{"inputs": "hi", "parameters": {"adapter_id": "x"}}', 422, "adapter_id"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_n_tokens": 99}}', 422, "top_n_tokens"),
    ("/generate", b'{"inputs": "hi",', 422, "not valid JSON"),
    ("/generate", b'{"inputs": "\xff\xfe"}', 422, "UTF-8"),
    ("/generate", b"[" * 100000, 422, "nests too deeply"),
    ("/generate_stream", b"[1, 2]", 422, "JSON object"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [[]]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, "a"]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [5000000]}', 400, "Token id 5000000 is out of vocabulary"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 999}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e-300, "seed": 1e400}', 400, "seed"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}', 400, "seed"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 99}', 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "n": 3, "best_of": 2}', 400, "best_of"),
    ("/v1/completions", b'{"prompt": "hi", "user": {}}', 400, "user"),
    ("/v1/completions", b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400,
     "stream_options"),
    ("/v1/completions", b'{"prompt": "hi", "frequency_penalty": 3}', 400, "frequency_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"x5": 10}}', 400,
     "logit_bias: keys must be token ids"),
    ("/v1/completions", b'{"prompt": "hi", "colour": 1}', 400, "colour"),
    ("/v1/completions", b"not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "", "content": "x"}]}', 400,
     "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": '
     b'"image_url"}]}]}', 400, "messages[0].content[0].type"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"max_completion_tokens": 999}', 400, "max_completion_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"top_logprobs": 2}', 400, "top_logprobs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"tools": [{"type": "function"}]}', 400, "tools"),
    # Each of these was a 500 with a traceback (a hostile re-test, round 4).
    ("/v1/completions", '{"prompt": "a", "logit_bias": {"\u00b2": 1}}'.encode(), 400,
     "logit_bias: keys must be token ids"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"' + b"0" * 5000 + b'1": 1}}', 400,
     "logit_bias: keys must be token ids"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"1": 1, "01": 2}}', 400,
     "name the same token"),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}", 400,
     "nests deeper than 32 levels"),
    ("/generate", b'{"inputs": "a", "parameters": ' + b'{"a": ' * 500 + b"1" + b"}" * 501, 422,
     "nests deeper than 32 levels"),
    ("/invocations", b'{"prompt": "a", "x": ' + b"[" * 500 + b"]" * 500 + b"}", 400,
     "nests deeper than 32 levels"),
    ("/tokenize", b'{"prompt": "a", "messages": ' + b"[" * 500 + b"]" * 500 + b"}", 400,
     "nests deeper than 32 levels"),
    ("/nowhere", b"{}", 404, "Not Found"),
]  # fmt: skip


def test_bad_inputs_get_a_clear_json_4xx_and_the_server_stays_healthy(server):
    before = httpx.post(
        server.url + "/generate", json={"inputs": "river", "parameters": {"max_new_tokens": 6}}
    ).json()
    for route, body, status, words in BAD:
        r = httpx.post(
            server.url + route, content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == status, (route, body[:80], r.text)
        err = r.json()["error"]  # every error is JSON, in its route family's shape
        message = err["message"] if isinstance(err, dict) else err  # OpenAI's shape, or TGI's
        assert words in message, (body[:80], message)
    assert httpx.get(server.url + "/health").status_code == 200
    after = httpx.post(
        server.url + "/generate", json={"inputs": "river", "parameters": {"max_new_tokens": 6}}
    ).json()
    assert after == before


EXTREME = [
    # Accepted and computed: a temperature below the sampler's minimum is greedy, the smallest
    # top_p keeps one token, the largest seed is a seed.
    ("/generate", {"inputs": "river", "parameters": {"max_new_tokens": 6, "temperature": 1e-300}}),
    ("/generate", {"inputs": "river", "parameters": {"max_new_tokens": 6, "temperature": 1e-38,
                                                     "do_sample": True}}),
    ("/generate", {"inputs": "river", "parameters": {"max_new_tokens": 6, "do_sample": True,
                                                     "top_p": 1e-300}}),
    ("/generate", {"inputs": "river", "parameters": {"max_new_tokens": 6, "do_sample": True,
                                                     "seed": 2**64 - 1, "top_k": 10**15}}),
    ("/v1/completions", {"prompt": "river", "max_tokens": 6, "temperature": 1e-300}),
]  # fmt: skip


def test_extreme_but_valid_parameters_are_computed_and_harm_nobody(server):
    """Parameters at the edges of what the sampler computes: each gets a 200 with a finite
    answer, and a greedy request that runs beside them is unaffected."""
    greedy = {"inputs": "river", "parameters": {"max_new_tokens": 6}}
    before = httpx.post(server.url + "/generate", json=greedy).json()["generated_text"]
    results = {}

    def call(i, route, body):
        results[i] = httpx.post(server.url + route, json=body, timeout=60)

    threads = [threading.Thread(target=call, args=(i, *c)) for i, c in enumerate(EXTREME)]
    threads.append(threading.Thread(target=call, args=("greedy", "/generate", greedy)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, (_, body) in enumerate(EXTREME):
        assert results[i].status_code == 200, (body, results[i].text)
    assert results["greedy"].json()["generated_text"] == before
    # Temperatures below the minimum are greedy on both route families.
    assert results[0].json()["generated_text"] == before
    assert results[4].json()["choices"][0]["text"] == before


def test_32_concurrent_streaming_clients_equal_sequential(server):
    prompts = [f"{w} river number {i}" for i, w in enumerate(["the", "king", "water", "a"] * 8)]
    body = lambda p: {"inputs": p, "parameters": {"max_new_tokens": 12}}  # noqa: E731
    sequential = {
        p: httpx.post(server.url + "/generate", json=body(p), timeout=60).json()["generated_text"]
        for p in prompts
    }
    results, errors = {}, []

    def client(p):
        try:
            text, final = "", None
            with httpx.stream(
                "POST", server.url + "/generate_stream", json=body(p), timeout=60
            ) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        ev = json.loads(line[5:])
                        text += ev["token"]["text"]
                        final = ev["generated_text"]
            results[p] = (text, final)
        except Exception as e:  # collected and reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 32
    for p in prompts:
        assert results[p] == (sequential[p], sequential[p])


def test_no_rank_listens_beyond_loopback(server):
    """A one-host job binds nothing but 127.0.0.1: the rendezvous store (torch's own binds every
    interface), gloo's pairs and HTTP; anyone else on the network reaches no port of it."""
    import ipaddress

    import psutil

    procs = [psutil.Process(server.proc.pid), *server.ranks]
    listening = [(p.pid, c.laddr) for p in procs for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]  # fmt: skip
    assert len(listening) >= 3  # HTTP, the store, gloo at least
    assert all(ipaddress.ip_address(a.ip).is_loopback for _, a in listening), listening


def test_client_disconnect_mid_stream_frees_its_slot(server):
    cancelled = server.metric("mpinfer_cancelled_requests_total")
    with httpx.stream(
        "POST",
        server.url + "/generate_stream",
        json={"inputs": "the", "parameters": {"max_new_tokens": 200}},
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    deadline = time.time() + 15
    while time.time() < deadline:
        if (
            server.metric("mpinfer_running_slots") == 0
            and server.metric("mpinfer_cancelled_requests_total") > cancelled
        ):
            break
        time.sleep(0.1)
    assert server.metric("mpinfer_running_slots") == 0
    assert server.metric("mpinfer_cancelled_requests_total") == cancelled + 1
    assert server.metric("mpinfer_generated_tokens_total") > 0
    # Its KV blocks are back: nothing held, every block free (cached prefixes included).
    assert server.metric("mpinfer_kv_blocks_used") == 0
    info = httpx.get(server.url + "/info", headers=server.headers).json()
    assert server.metric("mpinfer_kv_blocks_free") == info["kv_cache_blocks"] > 0


def test_the_server_freezes_its_start_up_heap_and_times_gc_pauses(server):
    """Start-up's objects (torch, transformers, FastAPI, the model: over 100,000 of them) are
    frozen out of the collector's walks (heap.settle), and its pauses by generation are on
    /metrics from before start-up ended: the full collection before the freeze is counted."""
    assert server.metric("mpinfer_gc_frozen_objects") > 100_000
    assert server.metric('mpinfer_gc_pause_seconds_count{generation="2"}') >= 1
    assert server.metric('mpinfer_gc_pause_seconds_sum{generation="2"}') > 0


AUTH = {"authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def limited(ckpts):
    s = Server(
        ckpts["st_sharded"],
        'server.api_key="s3cret"',
        "server.max_batch_slots=1",
        "server.max_queue=1",
        "server.max_body_bytes=4096",
        "server.max_seq_len=300",
        "server.shutdown_timeout=10",
        launcher="torchrun",
    )
    s.headers = AUTH
    yield s
    s.stop()


def test_auth_body_limit_and_full_queue(limited):
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 3}}
    assert httpx.post(limited.url + "/generate", json=body).status_code == 401
    r = httpx.post(limited.url + "/generate", json=body, headers={"authorization": "Bearer no"})
    assert r.status_code == 401 and "bearer token" in r.json()["error"]
    assert httpx.get(limited.url + "/health").status_code == 200  # open to load balancers
    assert httpx.post(limited.url + "/generate", json=body, headers=AUTH).status_code == 200
    big = {"inputs": "x" * 5000}
    assert httpx.post(limited.url + "/generate", json=big, headers=AUTH).status_code == 413
    # One slot, one queue place: of 6 long requests at once, some must be turned away.
    codes, messages = [], []

    def long_request():
        r = httpx.post(
            limited.url + "/generate",
            headers=AUTH,
            timeout=120,
            json={"inputs": "a", "parameters": {"max_new_tokens": 150}},
        )
        codes.append(r.status_code)
        if r.status_code == 429:
            messages.append(r.json()["error"])

    threads = [threading.Thread(target=long_request) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert codes.count(429) >= 1 and codes.count(200) >= 1, codes
    assert "queue is full" in messages[0]


def test_sigterm_drains_and_every_rank_exits_0(limited):
    result = {}

    def in_flight():
        r = httpx.post(
            limited.url + "/generate",
            headers=AUTH,
            timeout=60,
            json={"inputs": "a", "parameters": {"max_new_tokens": 250, "details": True}},
        )
        result["status"] = r.status_code
        result["tokens"] = r.json()["details"]["generated_tokens"] if r.status_code == 200 else 0

    # SIGTERM to rank 0 alone (what torchrun does first, for every rank): a clean drain.
    pids = [limited.rank_pid(0), limited.rank_pid(1)]
    t = threading.Thread(target=in_flight)
    t.start()
    while limited.metric("mpinfer_running_slots") < 1:
        time.sleep(0.02)
    os.kill(pids[0], signal.SIGTERM)
    time.sleep(0.1)
    health = httpx.get(limited.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "stopping"
    t.join(timeout=60)
    assert result["status"] == 200  # finished inside the shutdown timeout
    assert result["tokens"] == 250
    assert limited.proc.wait(timeout=60) == 0, limited.output()[-3000:]
    assert "exitcode" not in limited.output()


def test_a_stream_nobody_reads_is_cancelled_and_its_memory_let_go(server):
    """64 streamed generations (with logprobs, about 1 KB an event) to a client that never
    reads: once the socket buffers are full and more than server.max_stream_backlog (512)
    events wait, the generations are cancelled (their slots free), the stream ends with a 408
    error, rank 0's memory is back where it was, and other clients were served meanwhile."""
    import psutil

    rank0 = psutil.Process(server.ranks[0].pid)
    rss = rank0.memory_info().rss
    dropped = server.metric("mpinfer_dropped_streams_total")
    body = json.dumps({"prompt": ["a", "b", "c", "d"], "n": 16, "max_tokens": 250,
                       "stream": True, "ignore_eos": True, "logprobs": 5}).encode()  # fmt: skip
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    try:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        # The status line, peeked (the client still reads nothing): a refusal fails here with
        # the server's answer, not after a minute of waiting for a drop that cannot come.
        s.settimeout(30)
        status = s.recv(12, socket.MSG_PEEK)
        assert status.startswith(b"HTTP/1.1 200"), s.recv(4096)
        deadline = time.time() + 60
        while server.metric("mpinfer_dropped_streams_total") == dropped and time.time() < deadline:
            other = httpx.post(
                server.url + "/generate",
                timeout=30,
                json={"inputs": "river", "parameters": {"max_new_tokens": 2}},
            )
            assert other.status_code == 200
            time.sleep(0.2)
        assert server.metric("mpinfer_dropped_streams_total") == dropped + 1
        while server.metric("mpinfer_running_slots") > 0 and time.time() < deadline:
            time.sleep(0.1)
        assert server.metric("mpinfer_running_slots") == 0
        s.settimeout(5)
        tail = b""
        while not tail.endswith(b"\r\n0\r\n\r\n"):  # the stream's last chunk
            chunk = s.recv(1 << 20)
            assert chunk, tail
            tail = (tail + chunk)[-2000:]
    finally:
        s.close()
    assert b"read its stream too slowly" in tail and b'"code": 408' in tail
    assert rank0.memory_info().rss - rss < 64 * 2**20
