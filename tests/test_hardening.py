"""Nothing a client sends takes the server down: a bounded schema-driven fuzz run (schemathesis
against /openapi.json), and a soak of 64 concurrent streaming clients with random disconnects
and sampling parameters at the edges of their ranges. After each: no 5xx, /health 200, a greedy
answer unchanged, no slot left running, host RAM flat."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from .conftest import ENV, Server

FUZZ_SECONDS = 30
SOAK_SECONDS = 45
SOAK_CLIENTS = 64
RSS_GROWTH_MIB = 64  # per rank, between the first and the last seconds of the soak


@pytest.fixture(scope="module")
def hardened(ckpts):
    s = Server(ckpts["st_sharded"], "server.max_seq_len=256", "server.max_batch_slots=16",
               "server.max_queue=512", quant="int8")  # fmt: skip
    yield s
    s.stop()


GREEDY = {"inputs": "the river and the king", "parameters": {"max_new_tokens": 12}}


def greedy_answer(server) -> str:
    return httpx.post(server.url + "/generate", json=GREEDY, timeout=60).json()["generated_text"]


def fuzz(server, tmp_path, name: str, *args: str) -> dict:
    """One schemathesis run against /openapi.json (only the not-a-server-error check): its
    report, after asserting it found no failure."""
    report = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
         "--checks", "not_a_server_error", "--seed", "7", "--request-timeout", "60", *args,
         "--report", "json", "--report-json-path", str(report)],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=FUZZ_SECONDS + 120,
    )  # fmt: skip
    result = json.loads(report.read_text())
    cases = result["test_cases"]
    print(f"\nfuzz, {name}: {cases['generated']} cases, {cases['with_failures']} with failures, "
          f"{cases['errored']} errored, {len(result['failures'])} failures")  # fmt: skip
    assert proc.returncode == 0 and not result["failures"], proc.stdout[-4000:]
    return result


def test_schema_driven_fuzzing_finds_no_server_error(hardened, tmp_path):
    before = greedy_answer(hardened)
    # Every operation of the schema, 5 random cases each, whatever the machine's speed (54
    # cases, 11 s on an idle 2-core machine): a run bounded by time alone reached 3 of 18
    # operations on a busy one, because its coverage phase alone is 3,078 cases (135 s idle).
    each = fuzz(hardened, tmp_path, "each", "--phases", "fuzzing", "--max-examples", "5")
    ops = each["operations"]
    assert ops["tested"] == ops["selected"] == ops["total"] > 0, ops
    # then as far as FUZZ_SECONDS reach, every phase (boundary values first)
    fuzz(hardened, tmp_path, "timed", "--max-examples", "25", "--max-time", str(FUZZ_SECONDS))
    assert httpx.get(hardened.url + "/health").status_code == 200
    assert greedy_answer(hardened) == before
    assert "Traceback" not in hardened.output()


def soak_body(rng: random.Random) -> tuple[str, dict]:
    """A valid request of any kind, its parameters often at the edges of their ranges."""
    edge = rng.choice([
        {}, {"temperature": 1e-300}, {"temperature": 50.0}, {"top_p": 1e-300},
        {"top_k": 10**15}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"repetition_penalty": 0.01},
        {"repetition_penalty": 100.0}, {"typical_p": 1e-9}, {"frequency_penalty": -2.0},
        {"presence_penalty": 2.0}, {"top_p": 0.5, "top_k": 3, "temperature": 0.7},
    ])  # fmt: skip
    n = rng.randint(1, 48)
    kind = rng.choice(["tgi", "completions", "chat"])
    if kind == "tgi":
        params = {"max_new_tokens": n, "do_sample": rng.random() < 0.7,
                  "top_n_tokens": rng.choice([0, 3]), **edge}  # fmt: skip
        params.pop("presence_penalty", None)
        if params.get("seed", 0) < 0:  # TGI's seeds are unsigned: its top edge instead
            params["seed"] = 2**64 - 1
        return "/generate_stream", {"inputs": f"river {rng.random()}", "parameters": params}
    body = {"max_tokens": n, "stream": True, "n": rng.choice([1, 1, 2]), **edge,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if kind == "completions":
        return "/v1/completions", {**body, "prompt": f"king {rng.random()}",
                                   "logprobs": rng.choice([None, 2])}  # fmt: skip
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]}


async def soak_client(url: str, seed: int, stop_at: float, tally: dict) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60) as client:
        while time.time() < stop_at:
            route, body = soak_body(rng)
            leave_after = rng.choice([None, None, None, 1, 3])  # a client that walks away
            try:
                async with client.stream("POST", url + route, json=body) as r:
                    tally[r.status_code] = tally.get(r.status_code, 0) + 1
                    if r.status_code != 200:
                        tally.setdefault("bodies", []).append((route, body, await r.aread()))
                        continue
                    events = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and '"error"' in line[:40]:
                            tally.setdefault("errors", []).append((route, body, line))
                        events += line.startswith("data:")
                        if leave_after is not None and events >= leave_after:
                            tally["left"] = tally.get("left", 0) + 1
                            break
            except httpx.HTTPError as e:
                tally.setdefault("http_errors", []).append(repr(e))


def test_soak_64_streaming_clients_with_disconnects_and_extreme_parameters(hardened):
    before = greedy_answer(hardened)
    ranks = [psutil.Process(p.pid) for p in hardened.ranks]
    tally: dict = {}
    rss: list[list[float]] = []

    async def main():
        stop_at = time.time() + SOAK_SECONDS
        clients = [soak_client(hardened.url, i, stop_at, tally) for i in range(SOAK_CLIENTS)]

        async def sample_rss():
            while time.time() < stop_at:
                rss.append([p.memory_info().rss / 2**20 for p in ranks])
                await asyncio.sleep(1)

        await asyncio.gather(*clients, sample_rss())

    asyncio.run(main())
    requests = sum(v for k, v in tally.items() if isinstance(k, int))
    growth = [last - first for first, last in zip(rss[3], rss[-1])]
    print(f"\nsoak: {requests} requests ({tally.get('left', 0)} walked away), statuses "
          f"{ {k: v for k, v in tally.items() if isinstance(k, int)} }, RSS growth per rank "
          f"{[f'{g:.1f}' for g in growth]} MiB")  # fmt: skip
    assert set(k for k in tally if isinstance(k, int)) == {200}, tally.get("bodies", [])[:3]
    assert not tally.get("errors") and not tally.get("http_errors"), tally
    assert requests > SOAK_CLIENTS and tally.get("left", 0) > 0
    deadline = time.time() + 15
    while hardened.metric("mpinfer_running_slots") and time.time() < deadline:
        time.sleep(0.2)
    assert hardened.metric("mpinfer_running_slots") == 0  # no leaked slot
    assert hardened.metric("mpinfer_kv_blocks_used") == 0  # and no leaked KV block
    assert hardened.metric("mpinfer_queue_depth") == 0
    assert hardened.metric("mpinfer_failed_requests_total") == 0
    assert all(g < RSS_GROWTH_MIB for g in growth), growth
    assert greedy_answer(hardened) == before
