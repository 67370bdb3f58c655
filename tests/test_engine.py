"""The engine under torchrun (tp=2, gloo): continuous batching, sampling, stops, cancellation,
a full queue, and a fault on a worker rank. One torchrun job runs every scenario
(tests/engine_worker.py); the tests read what it recorded."""

from __future__ import annotations

import json
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


def test_fault_on_a_worker_rank_ends_every_rank_nonzero(ckpts, tmp_path):
    t0 = time.time()
    proc = torchrun(2, ["tests/engine_worker.py", str(ckpts["st_sharded"]), str(tmp_path / "x"),
                        "fault"], timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "injected fault in rank 1's step" in proc.stderr
    assert "[rank 0] ERROR engine failed" in proc.stderr  # rank 0 saw it too, and logged it
    assert time.time() - t0 < 60  # well inside the 30 s collective timeout + start-up


def test_cache_allocation_warms_every_int8_row_bucket():
    """Start-up runs one decode step per row bucket of the int8 kernels that the slots reach
    (1, 2-16, 17-32, 33-64 rows), over distinct slots at position 0, so a GPU autotunes before the
    first request instead of during it."""
    from types import SimpleNamespace

    import torch

    from mpinfer.engine import allocate_cache
    from mpinfer.plan import BloomShape

    calls = []

    def model(ids, cache, *, slots, start_pos, valid_from, kv_len):
        calls.append((ids.shape, slots.tolist(), start_pos.tolist(), kv_len, cache.slots))

    shape = BloomShape(vocab_size=64, hidden_size=16, n_layer=1, n_head=2)
    for slots, rows in ((1, [1]), (4, [1, 2]), (20, [1, 2, 17]), (40, [1, 2, 17, 33])):
        calls.clear()
        loaded = SimpleNamespace(shape=shape, tp=SimpleNamespace(tp_size=1), model=model,
                                 dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
        cache = allocate_cache(loaded, slots, 8)
        assert cache.slots == slots and cache.max_seq == 8
        assert [c[0] for c in calls] == [(r, 1) for r in rows]
        assert [c[1] for c in calls] == [list(range(r)) for r in rows]
        assert all(set(c[2]) == {0} and c[3] == 1 for c in calls)
