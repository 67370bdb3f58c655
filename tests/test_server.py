"""The HTTP server as real processes: torchrun, tp=2, the tiny model, 127.0.0.1 on a free port.
Clients: the official `openai` client, Hugging Face's `text-generation` client, httpx."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import psutil
import pytest

from mpinfer.dist import torchrun_command

from .conftest import ROOT

PROMPTS = ["the capital of france is", "river king queen", "café 東京 water", "a"]
MAX_NEW = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *settings: str):
        self.port = free_port()
        self.headers = {}
        self.url = f"http://127.0.0.1:{self.port}"
        args = torchrun_command(
            2,
            [
                "launch/serve.py",
                "--model",
                str(model),
                "--port",
                str(self.port),
                "--quant",
                "none",
                "--dtype",
                "float32",
                "--set",
                "parallel.timeout_s=20",
                *[x for s in settings for x in ("--set", s)],
            ],
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.log = open(ROOT / f".server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 90
        while time.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            assert self.proc.poll() is None, self.output()
            time.sleep(0.2)
        raise AssertionError("server did not become ready:\n" + self.output())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def rank_pid(self, rank: int) -> int:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child.pid
            except psutil.Error:
                continue
        raise AssertionError(f"no rank {rank} process")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.log.close()
        os.unlink(self.log.name)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", headers=self.headers).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(name)


@pytest.fixture(scope="module")
def server(ckpts):
    s = Server(ckpts["st_sharded"], "server.max_seq_len=256", "server.max_queue=64")
    yield s
    s.stop()


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
    (
        "/generate",
        b'{"inputs": "hi", "parameters": {"max_new_tokens": 999}}',
        422,
        "max_new_tokens",
    ),
    ("/generate", b'{"inputs": "hi", "parameters": {"temperature": -1}}', 422, "temperature"),
    ("/generate", b'{"inputs": "hi", "parameters": {"temperature": NaN}}', 422, "temperature"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_p": 1.5}}', 422, "top_p"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_p": 0}}', 422, "top_p"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_k": -3}}', 422, "top_k"),
    (
        "/generate",
        b'{"inputs": "hi", "parameters": {"stop": ["a","b","c","d","e","f","g","h","i"]}}',
        422,
        "stop",
    ),
    ("/generate", b'{"inputs": "hi", "parameters": {"stop": [""]}}', 422, "stop"),
    (
        "/generate",
        b'{"inputs": "hi", "parameters": {"max_new_tokens": "5"}}',
        422,
        "max_new_tokens",
    ),
    ("/generate", b'{"inputs": 5}', 422, "inputs"),
    ("/generate", b'{"inputs": "hi", "parameters": {"best_of": 2}}', 422, "best_of"),
    ("/generate", b'{"inputs": "hi", "parameters": {"colour": 1}}', 422, "colour"),
    ("/generate", b'{"inputs": "hi", "parameters": {"adapter_id": "x"}}', 422, "adapter_id"),
    ("/generate", b'{"inputs": "hi",', 422, "not valid JSON"),
    ("/generate", b'{"inputs": "\xff\xfe"}', 422, "UTF-8"),
    ("/generate_stream", b"[1, 2]", 422, "JSON object"),
    ("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "n"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400, "max_new_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 3}', 400, "logprobs"),
    ("/v1/completions", b"not json", 400, "not valid JSON"),
]


def test_bad_inputs_get_a_clear_4xx_and_the_server_stays_healthy(server):
    before = httpx.post(
        server.url + "/generate", json={"inputs": "river", "parameters": {"max_new_tokens": 6}}
    ).json()
    for route, body, status, words in BAD:
        r = httpx.post(
            server.url + route, content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == status, (route, body, r.text)
        err = r.json()["error"]
        message = err["message"] if isinstance(err, dict) else err
        assert words in message, (body, message)
    assert httpx.get(server.url + "/health").status_code == 200
    after = httpx.post(
        server.url + "/generate", json={"inputs": "river", "parameters": {"max_new_tokens": 6}}
    ).json()
    assert after == before


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


def test_sigkill_of_rank_1_ends_every_process_nonzero(ckpts):
    s = Server(ckpts["st_sharded"], "server.max_seq_len=256")
    try:
        outcome = {}

        def stream():
            try:
                with httpx.stream(
                    "POST",
                    s.url + "/generate_stream",
                    timeout=60,
                    json={"inputs": "a", "parameters": {"max_new_tokens": 200}},
                ) as r:
                    outcome["events"] = [line for line in r.iter_lines() if line]
            except httpx.HTTPError as e:
                outcome["error"] = repr(e)

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        t0 = time.time()
        os.kill(s.rank_pid(1), signal.SIGKILL)
        code = s.proc.wait(timeout=90)
        assert code != 0
        assert time.time() - t0 < 60
        t.join(timeout=30)
        # The client saw the failure: an error event, or the connection ended without a final one.
        events = outcome.get("events", [])
        assert "error" in outcome or not events or 'generated_text": "' not in events[-1]
    finally:
        s.stop()
