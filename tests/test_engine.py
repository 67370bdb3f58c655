"""The engine under torchrun (tp=2, gloo): continuous batching, sampling, stops, cancellation,
a full queue, and a fault on a worker rank. One torchrun job runs every scenario
(tests/engine_worker.py); the tests read what it recorded."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

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
    assert eng["queue_full"] == "the request queue is full (2 of 2 waiting)"
    assert "exceeds max_seq_len=96" in eng["too_long"]


def test_preempted_sequences_finish_identical_at_tp2(eng):
    """A pool too small for the batch (12 blocks of 8 tokens, 4 rows): sequences are preempted
    and recomputed on both ranks; every answer equals the same request on the full pool, greedy
    and seeded-sampled with penalties alike, and every block comes back."""
    p = eng["preempted"]
    assert p["preemptions"] >= 2 and p["reference_preemptions"] == 0
    for got, ref, params in zip(p["results"], p["reference"], p["params"], strict=True):
        assert got["token_ids"] == ref["token_ids"] and got["text"] == ref["text"]
        assert len(got["token_ids"]) == params["max_new_tokens"]
    assert any(params["do_sample"] for params in p["params"])
    assert p["available"] == p["blocks"]
    # The greedy ones also equal the first test's requests alone (their shorter budgets).
    for got, alone, params in zip(p["results"], eng["alone"], p["params"]):
        if not params["do_sample"]:
            assert got["token_ids"][: len(alone["token_ids"])] == alone["token_ids"]


def test_long_prompt_is_prefilled_in_chunks_without_stalling_decodes(eng):
    c = eng["chunked"]
    assert c["long"]["token_ids"] == c["long_alone"]["token_ids"]
    # 60 prompt tokens at 16 a step: the first token comes 4 steps after it was admitted...
    assert c["long"]["first_step"] >= c["decoding"]["first_step"] + 4
    # ...while the decoding request produced one token every step, never waiting.
    d = c["decoding"]
    assert d["last_step"] - d["first_step"] == len(d["token_ids"]) - 1 == 19
    # Chunked (16 a step) = whole (one step of 60): the same tokens; whole took 5 + 1 steps.
    assert c["whole"]["token_ids"] == c["long_alone"]["token_ids"]
    assert c["steps_whole"] <= 6
    # Prompt log-probabilities across the chunks' boundaries: those of the whole prompt, every
    # position (its rank in the vocabulary and its two alternatives too), alone or beside a decode.
    whole = c["whole"]
    assert whole["prompt_logprobs"][0] is None and None not in whole["prompt_logprobs"][1:]
    for got in (c["long_alone"], c["long"]):
        assert got["prompt_logprobs"][1:] == pytest.approx(whole["prompt_logprobs"][1:], abs=1e-4)
        assert got["prompt_ranks"] == whole["prompt_ranks"]
        for a, b in zip(got["prompt_top_logprobs"][1:], whole["prompt_top_logprobs"][1:]):
            assert [t for t, _ in a] == [t for t, _ in b]


def test_a_request_cancelled_mid_prompt_ends_at_once_and_frees_its_slot(eng):
    c = eng["cancel_mid_prompt"]
    assert c["result"]["finish_reason"] == "cancelled" and c["result"]["token_ids"] == []
    assert c["free"] == 4
    assert c["other"]["token_ids"] == eng["alone"][1]["token_ids"]


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

    from mpinfer.engine.step import STEP, Prefill, Step, decode_step_message, encode_step

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


def test_step_buckets_cover_every_token_count_up_to_a_full_step():
    """A step of n tokens replays the smallest captured bucket >= n, so the buckets must reach
    every n up to every slot decoding beside a full prompt budget, and never waste more than
    half a bucket (the decode buckets first: the batch-1 step stays a 1-token graph); a list
    names the buckets, and the full step is always one."""
    from mpinfer.engine.runner import step_buckets
    from mpinfer.model.memory import decode_buckets

    assert step_buckets(1, 0) == [1]
    assert step_buckets(8, 0) == [1, 2, 4, 8]
    assert step_buckets(32, 512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 544]
    assert step_buckets(48, 16) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert step_buckets(32, 512, "64, 8,1000") == [8, 64, 544]
    for slots in range(1, 70):
        for budget in (1, 7, 64, 100, 512, 1500):
            buckets = step_buckets(slots, budget)
            assert buckets[: len(decode_buckets(slots))] == decode_buckets(slots)
            assert buckets[-1] == slots + budget and buckets == sorted(set(buckets))
            for n in range(1, slots + budget + 1):
                bucket = next(b for b in buckets if b >= n)
                assert bucket < 2 * n or bucket == 1
    # Under server.max_step_tokens the full step is the cap (or, past it, the rows beside the
    # smallest prompt budget a step keeps).
    assert step_buckets(32, 512, max_step_tokens=512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert step_buckets(64, 512, max_step_tokens=512)[-1] == 512
    assert step_buckets(600, 512, max_step_tokens=512)[-1] == 616  # 600 rows + 16 prompt tokens


def test_a_step_carries_at_most_max_step_tokens():
    """steps.prompt_budget: what the decode rows leave of the cap, never more than the prompt
    budget, never less than MIN_PROMPT_TOKENS (prompts progress beside any number of rows);
    most_tokens is the largest step that allows, checked against every row count."""
    from mpinfer.model.steps import MIN_PROMPT_TOKENS, most_tokens, prompt_budget

    rng = random.Random(int.from_bytes(__import__("os").urandom(4), "little"))
    for _ in range(200):
        rows, slots = rng.randrange(0, 700), rng.randrange(1, 700)
        prefill, cap = rng.randrange(1, 2000), rng.choice([0, rng.randrange(1, 1100)])
        got = prompt_budget(rows, prefill, cap)
        if cap == 0:
            assert got == prefill
        else:
            assert got <= prefill and got >= min(prefill, MIN_PROMPT_TOKENS)
            assert rows + got <= cap or got == min(prefill, MIN_PROMPT_TOKENS)
        most = most_tokens(slots, prefill, cap)
        assert most == max(r + prompt_budget(r, prefill, cap) for r in range(slots + 1))
        assert cap == 0 or most <= max(cap, slots + MIN_PROMPT_TOKENS)


def test_step_layout_puts_decode_rows_first_and_cuts_chunks_into_tiles():
    """The flat batch of a step: decode rows, then every chunk's tokens in order; the rows that
    sample in `execute`'s order; a bucket's buffer padded with rows of -1 and empty tiles, its
    views of the sizes the kernels' fixed grids expect; tiles cover every chunk token once."""
    from mpinfer.engine.runner import Layout, StepInputs
    from mpinfer.engine.step import STEP, Prefill, Step
    from mpinfer.model.kernels.tuning import CHUNK_TILE

    rng = random.Random(5)
    for _ in range(100):
        slots = 8
        rows = rng.sample(range(slots), rng.randint(0, 4))
        free = [s for s in range(slots) if s not in rows]
        prefills = tuple(Prefill(s, rng.randrange(50), tuple(rng.randrange(1000) for _ in
                                 range(rng.randint(1, 150))), rng.random() < 0.5)
                         for s in rng.sample(free, rng.randint(0, 3)))  # fmt: skip
        step = Step(STEP, tuple(rows), tuple(rng.randrange(100) for _ in rows), prefills)
        lay = Layout.of(step)
        n = len(lay.ids)
        assert n == len(rows) + sum(len(p.tokens) for p in prefills) == len(lay.seq)
        assert lay.ids[: len(rows)] == [-1] * len(rows) and lay.seq[: len(rows)] == list(rows)
        expect_sample = list(range(len(rows))) + [
            lay.prefill_at[i] + len(p.tokens) - 1 for i, p in enumerate(prefills) if p.sample
        ]
        assert lay.sample == expect_sample
        covered = []
        for row, tok0, count, pos0 in lay.tiles(step):
            assert 0 < count <= CHUNK_TILE
            for j in range(count):
                assert lay.seq[tok0 + j] == row and lay.pos[tok0 + j] == pos0 + j
                covered.append(tok0 + j)
        assert sorted(covered) == list(range(len(rows), n))
        if not n:
            continue
        bucket = 1 << (n - 1).bit_length()
        inputs = StepInputs.allocate(bucket, slots, "cpu")
        inputs.buf.copy_(torch.tensor(inputs.host(lay, step, pad=3)))
        ids, nxt, seq, pos, dec_seq, dec_pos, sample, tiles = inputs.views()
        assert seq[:n].tolist() == lay.seq and (seq[n:] == -1).all()
        assert pos[:n].tolist() == lay.pos and (ids[n:] == 3).all()
        assert nxt[: len(rows)].tolist() == list(rows) and (nxt[len(rows) :] == -1).all()
        assert dec_seq[: len(rows)].tolist() == list(rows) and (dec_seq[len(rows) :] == -1).all()
        assert sample[: len(lay.sample)].tolist() == lay.sample
        used = [tuple(c) for c in tiles.t().tolist() if c[2]]
        assert used == lay.tiles(step)


def test_one_flat_forward_equals_separate_padded_forwards():
    """A mixed step as one flat forward (decode rows and prompt chunks of several rows, chunks
    continuing earlier ones) gives the same logits and the same cache as each row run alone
    through the padded forward; with blocks smaller than a row (a block table that is not the
    identity) as well."""
    from mpinfer.model.attention import FlatBatch, KVCache, read_kv
    from mpinfer.model.bloom import BloomModel, BloomShape
    from mpinfer.model.layers import TPGroup
    from mpinfer.model.quant import DenseMethod
    from mpinfer.tools.randmodel import randomize_model

    shape = BloomShape(vocab_size=300, hidden_size=64, n_layer=2, n_head=4)
    model = BloomModel(shape, TPGroup(0, 1), method=DenseMethod(), dtype=torch.float64)
    randomize_model(model, seed=3)
    model.after_load(torch.device("cpu"))
    for block_size in (None, 16):
        flat = KVCache.allocate(shape, 1, slots=4, max_seq=80, dtype=torch.float64, device="cpu",
                                block_size=block_size)  # fmt: skip
        if block_size:  # rows on shuffled blocks
            flat.tables = flat.tables.flatten()[torch.randperm(flat.tables.numel(),
                                                generator=torch.Generator().manual_seed(1))
                                                ].view_as(flat.tables)  # fmt: skip
        ref = KVCache.allocate(shape, 1, slots=4, max_seq=80, dtype=torch.float64, device="cpu")
        g = torch.Generator().manual_seed(7)
        history = {r: torch.randint(0, 300, (int(n),), generator=g) for r, n in
                   zip(range(4), (30, 1, 17, 40))}  # fmt: skip
        # Step 1: every row's first tokens, as one flat batch of four chunks.
        cuts = {0: 20, 1: 1, 2: 17, 3: 25}

        def run(segments, ids, cache):
            seq = [r for r, _, n, _ in segments for _ in range(n)]
            pos = [p + j for _, _, n, p in segments for j in range(n)]
            none = torch.zeros(0, dtype=torch.long)
            batch = FlatBatch(torch.tensor(seq), torch.tensor(pos), none, none,
                              torch.zeros((4, 0), dtype=torch.long), segments)  # fmt: skip
            return model.forward_flat(torch.tensor(ids), cache, batch)

        segs, ids, at = [], [], 0
        for r, c in cuts.items():
            segs.append((r, at, c, 0))
            ids += history[r][:c].tolist()
            at += c
        h1 = run(segs, ids, flat)
        # Step 2: rows 1 and 2 decode one token each, rows 0 and 3 continue their prompts.
        segs2 = [(1, 0, 1, 1), (2, 1, 1, 17), (0, 2, 10, 20), (3, 12, 15, 25)]
        extra = {1: torch.tensor([5]), 2: torch.tensor([9])}
        ids2 = [5, 9, *history[0][20:30].tolist(), *history[3][25:40].tolist()]
        h2 = run(segs2, ids2, flat)
        full = {0: history[0], 1: torch.cat([history[1], extra[1]]),
                2: torch.cat([history[2], extra[2]]), 3: history[3]}  # fmt: skip
        for r, seq in full.items():
            n = len(seq)
            want = model(seq[None], ref, slots=torch.tensor([r]), start_pos=torch.tensor([0]),
                         valid_from=torch.tensor([0]), kv_len=n, output="hidden")[0]  # fmt: skip
            s1 = next(s for s in segs if s[0] == r)
            s2 = next(s for s in segs2 if s[0] == r)
            got = torch.cat([h1[s1[1] : s1[1] + s1[2]], h2[s2[1] : s2[1] + s2[2]]])
            # float64 on both sides: only the summation order differs.
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
            for layer in range(2):
                a = read_kv(flat.k[layer], flat.tables, torch.tensor([r]), n)
                b = read_kv(ref.k[layer], ref.tables, torch.tensor([r]), n)
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def _scheduler(hold: int = 0, budget: int = 64, rows: int = 4, blocks: int = 1000,
               cap: int = 0):  # fmt: skip
    """A Scheduler as the engine builds one, with no model, runner or sampler."""
    from mpinfer.engine.blocks import BlockManager
    from mpinfer.engine.request import Sequence
    from mpinfer.engine.scheduler import Scheduler

    return Scheduler(BlockManager(blocks, 16, blocks_per_row=16), rows=rows,
                     max_prefill_tokens=budget, prefill_hold_steps=hold, max_step_tokens=cap,
                     new_sequence=lambda req: Sequence(req, -1, None))  # fmt: skip


def test_the_scheduler_keeps_every_step_under_the_step_cap():
    """With server.max_step_tokens, a step's prompt chunks fill what its decode rows leave of
    the cap: random prompts arriving while others decode, every step within the cap (or the
    rows beside the smallest chunk), and every prompt token scheduled exactly once."""
    from mpinfer.model.steps import MIN_PROMPT_TOKENS

    rng = random.Random(int.from_bytes(__import__("os").urandom(4), "little"))
    rows, cap = rng.choice([(8, 40), (24, 32), (6, 100)])
    sched = _scheduler(budget=64, rows=rows, cap=cap)
    requests = [_request(rng.randrange(1, 90), max_new=rng.randrange(1, 12))
                for _ in range(3 * rows)]  # fmt: skip
    sched.pending.extend(requests)
    scheduled = {id(r): 0 for r in requests}
    for _ in range(2000):
        if not sched.busy:
            break
        plan = sched.schedule()
        sched.blocks.take_updates()  # what the engine's step message carries
        decode = len(plan.step.decode_slots)
        chunk = sum(len(p.tokens) for p in plan.step.prefills)
        assert decode + chunk <= max(cap, decode + MIN_PROMPT_TOKENS), (decode, chunk)
        assert chunk <= 64
        for p in plan.step.prefills:
            scheduled[id(sched.running[p.slot].req)] += len(p.tokens)
        for seq, _ in plan.rows:
            seq.result.token_ids.append(7)
            if len(seq.result.token_ids) >= seq.req.params.max_new_tokens:
                seq.done = True
        for seq in [q for q in sched.running.values() if q.done]:
            sched.leave(seq)
    assert not sched.busy
    # the prompts share their openings: what the prefix cache held was not scheduled again
    cached = sched.blocks.cached_tokens
    assert sum(scheduled.values()) + cached == sum(len(r.prompt_ids) for r in requests)


def _request(prompt: int, max_new: int = 50):
    from mpinfer.engine.request import Request
    from mpinfer.engine.sampling import SamplingParams

    return Request(list(range(4, 4 + prompt)), SamplingParams(max_new_tokens=max_new),
                   lambda ev: None)  # fmt: skip


def test_prefill_hold_lets_a_short_prompt_wait_a_few_steps_while_rows_decode():
    """server.prefill_hold_steps: a prompt that fills little of the budget waits up to that many
    steps while rows decode, then runs; a prompt that fills the budget, or any prompt when
    nothing decodes, runs at once; 0 (the default) never waits."""
    from mpinfer.engine.request import Sequence

    def seq(slot: int, prompt: int, decoding: bool) -> Sequence:
        s = Sequence(_request(prompt), slot, None)
        if decoding:
            s.prompt_left, s.pos, s.scheduled = [], prompt, 1
        return s

    def prefill_steps(sched, steps: int) -> list[int]:
        return [sum(len(p.tokens) for p in sched.schedule().step.prefills) for _ in range(steps)]

    for hold in (0, 2, 5):
        sched = _scheduler(hold)
        sched.running = {0: seq(0, 5, True), 1: seq(1, 7, True), 2: seq(2, 10, False)}
        assert prefill_steps(sched, hold + 2) == [0] * hold + [10, 0]
    sched = _scheduler(3)  # a prompt at least the budget: at once, and its rest without waiting
    sched.running = {0: seq(0, 5, True), 1: seq(1, 100, False)}
    assert prefill_steps(sched, 3) == [64, 36, 0]
    sched = _scheduler(3)  # nothing decodes: no reason to wait
    sched.running = {1: seq(1, 10, False)}
    assert prefill_steps(sched, 1) == [10]


def test_the_scheduler_admits_plans_preempts_and_gives_rows_back_with_no_model():
    """Admission into free rows (the pool's blocks permitting), the plan of prompt chunks and
    decode rows, preemption of the newest sequence when a decode needs a block and none is
    left, the preempted one admitted first (before anything queued) once there is room, and a
    cancelled queued request reported, not admitted."""
    sched = _scheduler(rows=2, budget=100, blocks=7)  # 7 blocks of 16 tokens, 1 kept back
    a, b, c = _request(40), _request(40), _request(5)
    sched.pending.extend([a, b, c])
    plan = sched.schedule()
    # Two rows: a and b admitted (3 blocks each, one left), c waits for a row.
    assert [s.req for s in plan.admitted] == [a, b] and list(sched.pending) == [c]
    assert [len(p.tokens) for p in plan.step.prefills] == [40, 40]
    assert [(s.req, i) for s, i in plan.rows] == [(a, 0), (b, 0)]  # both sample a first token
    for s, _ in plan.rows:  # as the engine does when a token comes back
        s.result.token_ids.append(7)
    # Decoding: positions 40..47 fit their third block; position 48 needs a fourth each: b
    # (the newer) is preempted for a.
    for _ in range(8):
        plan = sched.schedule()
        assert plan.step.decode_slots == (0, 1) and not plan.preempted
        for s, _ in plan.rows:
            s.result.token_ids.append(7)
    plan = sched.schedule()
    assert [s.req for s in plan.preempted] == [b] and plan.step.decode_slots == (0,)
    assert sched.preempted[0].req is b and len(sched.free) == 1
    for s, _ in plan.rows:
        s.result.token_ids.append(7)
    c.cancelled = True
    plan = sched.schedule()
    # b comes back first (before anything queued), its prompt's two full blocks found in the
    # prefix cache: only the rest of its prompt and what it generated is recomputed. c, cancelled
    # while queued, is reported and never admitted.
    assert [s.req for s in plan.admitted] == [b] and plan.cancelled == [c] and not sched.pending
    chunk = plan.step.prefills[0]
    assert chunk.start == 32 and len(chunk.tokens) == 40 + 9 - 32
    sched.leave(sched.running[0])  # a ends: its row goes back
    assert sched.free == [0]


def test_one_stop_check_decides_every_ending():
    """stop_reason: EOS (unless ignore_eos), stop strings and stop ids (after min_tokens),
    max_new_tokens, in that order; wants_token is the length rule the scheduler plans with."""
    from mpinfer.engine.request import stop_reason, wants_token
    from mpinfer.engine.sampling import SamplingParams

    p = SamplingParams(max_new_tokens=5, stop_token_ids=(9,), min_tokens=2)
    assert stop_reason(2, 1, p, 2, False) == "eos"
    assert stop_reason(2, 5, p, 2, False) == "eos"  # EOS wins over the length
    assert stop_reason(9, 2, p, 2, False) == "" and stop_reason(9, 3, p, 2, False) == "stop"
    assert stop_reason(4, 3, p, 2, True) == "stop"
    assert stop_reason(4, 4, p, 2, False) == "" and stop_reason(4, 5, p, 2, False) == "length"
    ignore = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert stop_reason(2, 1, ignore, 2, False) == ""
    assert wants_token(4, p) and not wants_token(5, p)
