"""The engine under torchrun (tp=2, gloo): continuous batching, sampling, stops, cancellation,
a full queue, and a fault on a worker rank. One torchrun job runs every scenario
(tests/engine_worker.py); the tests read what it recorded."""

from __future__ import annotations

import json
import random
import time

import pytest

from .conftest import torchrun


@pytest.fixture(scope="module")
def eng(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "out.json"
    proc = torchrun(2, ["tests/engine_worker.py", str(ckpts["st_sharded"]), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_concurrent_greedy_requests_equal_each_alone(eng):
    for alone, batched in zip(eng["alone"], eng["batched"], strict=True):
        assert batched["token_ids"] == alone["token_ids"]
        assert batched["text"] == alone["text"] and batched["finish_reason"] == "length"
    # 8 requests, 4 slots: the later ones started when earlier ones left, not after all did.
    firsts = sorted(r["first_step"] for r in eng["batched"])
    lasts = sorted(r["last_step"] for r in eng["batched"])
    assert firsts[4] > firsts[0] and firsts[4] < lasts[-1]


def test_request_arriving_mid_decode_joins_the_running_batch(eng):
    first, late = eng["join"]["first"], eng["join"]["late"]
    # It got its first token while the first request was still decoding...
    assert first["first_step"] < late["first_step"] < first["last_step"]
    # ...and exactly the tokens it gets alone.
    assert late["token_ids"] == eng["alone"][2]["token_ids"]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(eng):
    alone1, alone2, in_batch = eng["seeded"]
    assert alone1 == alone2 == in_batch
    assert alone1 != eng["alone"][0]["token_ids"][: len(alone1)]  # it did sample, not argmax


def test_stop_string_spanning_tokens_ends_before_it_and_is_never_streamed(eng):
    s = eng["stop"]
    full = eng["alone"][0]["text"]
    assert s["result"]["finish_reason"] == "stop"
    assert s["result"]["text"] == full[: full.index(s["stop"])]
    assert s["streamed"] == s["result"]["text"]
    assert all(s["stop"] not in d for d in s["deltas"])


def test_eos_and_max_new_tokens_end_requests(eng):
    r = eng["eos"]["result"]
    assert r["finish_reason"] == "eos" and r["token_ids"][-1] == eng["eos"]["eos"]
    ref = eng["alone"][0]["token_ids"]
    assert r["token_ids"] == ref[: ref.index(eng["eos"]["eos"]) + 1]
    assert all(
        len(a["token_ids"]) == b for a, b in zip(eng["alone"], [12, 20, 7, 16, 9, 14, 5, 11])
    )


def test_cancel_frees_the_slot_and_full_queue_rejects(eng):
    c = eng["cancel"]
    assert c["result"]["finish_reason"] == "cancelled"
    assert 2 <= len(c["result"]["token_ids"]) < 60
    assert c["free"] == 4 and c["running"] == 0
    assert eng["queue_full"] == "the request queue is full (2 waiting)"
    assert "exceeds max_seq_len=96" in eng["too_long"]


def test_long_prompt_is_prefilled_in_chunks_without_stalling_decodes(eng):
    c = eng["chunked"]
    assert c["long"]["token_ids"] == c["long_alone"]["token_ids"]
    # 60 prompt tokens at 16 a step: the first token comes 4 steps after it was admitted...
    assert c["long"]["first_step"] >= c["decoding"]["first_step"] + 4
    # ...while the decoding request produced one token every step, never waiting.
    d = c["decoding"]
    assert d["last_step"] - d["first_step"] == len(d["token_ids"]) - 1 == 19


def test_a_fault_in_one_request_fails_that_request_alone(eng):
    """A request's sink that raises, and a row whose logits are NaN: each such request ends
    with an error event (its slot freed); every other request of the batch gets the tokens it
    gets alone, and the engine goes on to the next scenario."""
    f = eng["sink_fault"]
    assert f["victim"][-1] == "error" and "the client's sink broke" in f["victim_error"]
    assert f["victim"].count("token") == 3 and f["free"] == 4
    for got, i in zip(f["others"], (1, 2, 3)):
        assert got["token_ids"] == eng["alone"][i]["token_ids"]
    n = eng["nan_row"]
    assert "not finite" in n["victim_error"] and n["failed"] == 1 and n["free"] == 4
    assert n["victim_result"]["finish_reason"] == "error"
    for got, i in zip(n["others"], (1, 2)):
        assert got["token_ids"] == eng["alone"][i]["token_ids"]


def test_fault_on_a_worker_rank_ends_every_rank_nonzero(ckpts, tmp_path):
    t0 = time.time()
    proc = torchrun(2, ["tests/engine_worker.py", str(ckpts["st_sharded"]), str(tmp_path / "x"),
                        "fault"], timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "injected fault in rank 1's step" in proc.stderr
    assert "[rank 0] ERROR engine failed" in proc.stderr  # rank 0 saw it too, and logged it
    assert time.time() - t0 < 60  # well inside the 30 s collective timeout + start-up


def test_step_messages_survive_the_channel_encoding():
    """Every step rank 0 sends is rebuilt exactly by the other ranks (random steps, and the
    buffer's stale tail from a longer earlier step ignored)."""
    import random

    from mpinfer.runner import STEP, Prefill, Step, decode_step_message, encode_step

    rng = random.Random(0)
    for _ in range(200):
        slots = rng.sample(range(64), rng.randint(0, 10))
        prefills = tuple(
            Prefill(rng.randrange(64), rng.randrange(500),
                    tuple(rng.randrange(250880) for _ in range(rng.randint(1, 40))),
                    rng.random() < 0.5, rng.randint(-1, 20), rng.randint(-1, 250879))
            for _ in range(rng.randint(0, 4))
        )  # fmt: skip
        step = Step(STEP, tuple(slots), tuple(rng.randrange(2048) for _ in slots), prefills)
        data = encode_step(step) + [rng.randrange(1000) for _ in range(rng.randint(0, 50))]
        assert decode_step_message(data) == step


def test_decode_graph_buckets_and_warm_up_cover_every_batch():
    """A step with n decode rows replays the smallest captured bucket >= n, so the buckets must
    reach every n up to the slots; the GPU warm-up runs every bucket and the smallest row count
    of every int8 kernel bucket (1, 2-16, 17-32, 33-64) the slots reach, nothing beyond them."""
    from mpinfer.memory import decode_buckets
    from mpinfer.runner import warm_up_rows

    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    for slots in range(1, 130):
        buckets = decode_buckets(slots)
        assert buckets[-1] == slots and buckets == sorted(set(buckets))
        for n in range(1, slots + 1):
            bucket = next(b for b in buckets if b >= n)
            assert bucket < 2 * n or bucket == 1  # never more than twice the rows
        rows = warm_up_rows(slots)
        assert set(buckets) <= set(rows) and max(rows) == slots
        assert {1, 2, 17, 33} & set(range(1, slots + 1)) <= set(rows)


def test_prompt_chunks_batch_within_the_token_budget_and_the_cache():
    """A step's prompt chunks run as few forwards as the budget allows: longest first, each
    batch padded to its longest chunk within max_prefill_tokens, the padding inside the cache."""
    from mpinfer.runner import Prefill, group_prefills

    def chunks(*specs):
        return [Prefill(slot, start, tuple(range(n))) for slot, (start, n) in enumerate(specs)]

    # 32 short prompts of a burst: one forward.
    assert group_prefills(chunks(*[(0, 13)] * 32), 512, 256) == [list(range(32))]
    # One long chunk and short ones: the long one alone, the short ones together.
    assert group_prefills(chunks((0, 5), (0, 400), (0, 7), (0, 6)), 512, 1024) == [[1], [2, 3, 0]]
    # Padding a late chunk (start 250) to 10 would run past max_seq = 256: its own batch.
    assert group_prefills(chunks((0, 10), (250, 3)), 512, 256) == [[0], [1]]
    for budget in (16, 64, 512):
        rng = random.Random(budget)
        ps = chunks(*[(rng.randrange(100), rng.randint(1, 16)) for _ in range(40)])
        groups = group_prefills(ps, budget, 128)
        assert sorted(i for g in groups for i in g) == list(range(40))
        for g in groups:
            T = max(len(ps[i].tokens) for i in g)
            assert len(g) == 1 or (len(g) * T <= budget and all(ps[i].start + T <= 128 for i in g))
