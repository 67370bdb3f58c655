"""The batched sampler against transformers' reference processors, row by row, on fresh random
logits; its draws, seeds and packed outputs; and the incremental detokenizer on multi-byte
characters and stop strings."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mpinfer.engine.detok import TextStream
from mpinfer.engine.draw import DRAW_BLOCK, draw, prefix_sums
from mpinfer.engine.sampling import (
    MAX_TOP_N,
    Row,
    Sampler,
    SamplingParams,
    process_logits,
    row_table,
    uniform,
)
from mpinfer.tools.diag.sampler_cost import one_scan_draw

V = 500


def hf_reference(logits, params: SamplingParams, seen):
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    x, ids = logits[None].clone(), seen[None]
    if params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    if params.greedy:
        return x[0]
    if params.temperature != 1.0:
        x = TemperatureLogitsWarper(params.temperature)(ids, x)
    if params.top_k:
        x = TopKLogitsWarper(params.top_k)(ids, x)
    if params.top_p < 1.0:
        x = TopPLogitsWarper(params.top_p)(ids, x)
    if params.typical_p < 1.0:
        x = TypicalLogitsWarper(params.typical_p)(ids, x)
    return x[0]


CASES = [
    {"temperature": 0.5},
    {"temperature": 1.7},
    {"top_k": 7},
    {"top_k": 40},
    {"top_p": 0.6},
    {"typical_p": 0.4},
    {"repetition_penalty": 1.3},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1},
    {"top_k": 3, "typical_p": 0.7},
    {},  # sampling with no processor
]


def batch_outputs(rows_params, logits, seen_ids):
    """process_logits over one batch holding every row, with each row's prompt history."""
    rows = [Row(i, p, 0) for i, p in enumerate(rows_params)]
    t, needs = row_table(rows, V)
    seen = torch.zeros((len(rows), V), dtype=torch.bool)
    for i, ids in enumerate(seen_ids):
        seen[i, ids] = True
    counts = torch.zeros((len(rows), V), dtype=torch.int32)
    return process_logits(logits, t, needs, seen=seen if needs.history else None,
                          counts=counts if needs.history else None)  # fmt: skip


def test_every_row_of_a_mixed_batch_matches_transformers_alone():
    """Ten sampling rows with different processors and a greedy row with a repetition penalty,
    in one batch: each row's processed logits equal transformers' processors on that row
    alone (same tokens removed, same values kept)."""
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(do_sample=True, seed=1, **kw) for kw in CASES]
    params.append(SamplingParams(repetition_penalty=10.0))  # greedy: the penalty only
    logits = torch.randn(len(params), V, generator=g) * 3
    seen_ids = [torch.randint(0, V, (7,), generator=g) for _ in params]
    penalized, processed = batch_outputs(params, logits, seen_ids)
    for i, p in enumerate(params):
        ref = hf_reference(logits[i], p, seen_ids[i])
        ours = penalized[i] if p.greedy else processed[i]
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (i, p)
        kept = ~torch.isinf(ref)
        torch.testing.assert_close(ours[kept], ref[kept])
        if {"top_k", "top_p", "typical_p"} & set(CASES[i] if i < len(CASES) else {}):
            assert 0 < kept.sum() < V  # it did cut the distribution


def test_greedy_rows_take_the_penalized_argmax_and_blocked_eos():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    best = int(logits[0].argmax())
    params = [SamplingParams(repetition_penalty=10.0),
              SamplingParams(min_tokens=3, stop_token_ids=(7, 9))]  # fmt: skip
    rows = [Row(0, params[0], 0), Row(1, params[1], 0)]
    t, needs = row_table(rows, V)
    seen = torch.zeros((2, V), dtype=torch.bool)
    seen[0, best] = True
    counts = torch.zeros((2, V), dtype=torch.int32)
    eos = int(logits[1].argmax())
    penalized, _ = process_logits(logits, t, needs, seen=seen, counts=counts, eos_token_id=eos)
    assert int(penalized[0].argmax()) != best and not torch.isinf(penalized[0]).any()
    assert penalized[1, eos] == float("-inf")  # index 0 < min_tokens: EOS cannot end it yet
    # nor can its stop tokens (vLLM's min_tokens), and nothing else is touched in that row
    assert penalized[1, 7] == penalized[1, 9] == float("-inf")
    assert torch.isinf(penalized[1]).sum() == len({eos, 7, 9})
    # From index 3 on, they may come.
    t, needs = row_table([Row(1, params[1], 3)], V)
    penalized, _ = process_logits(logits[1:], t, needs, seen=seen[1:], counts=counts[1:],
                                  eos_token_id=eos)  # fmt: skip
    assert not torch.isinf(penalized).any()


def test_frequency_and_presence_penalties_are_openais():
    """logit - frequency_penalty * count - presence_penalty * (count > 0) over generated tokens."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(do_sample=True, frequency_penalty=0.5, presence_penalty=0.25)
    t, needs = row_table([Row(0, p, 0)], V)
    counts = torch.zeros((1, V), dtype=torch.int32)
    counts[0, 10], counts[0, 20] = 3, 1
    seen = torch.zeros((1, V), dtype=torch.bool)
    penalized, _ = process_logits(logits, t, needs, seen=seen, counts=counts)
    expected = logits.clone()
    expected[0, 10] -= 0.5 * 3 + 0.25
    expected[0, 20] -= 0.5 + 0.25
    torch.testing.assert_close(penalized, expected)


def test_draw_inverts_the_cdf_and_never_picks_a_removed_token():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, V, generator=g)
    x[:, ::2] = float("-inf")  # every even token removed
    probs = x.softmax(-1)
    for u in [0.0, 1e-9, 0.25, 0.5, 0.999999, 1 - 2**-53]:
        tokens = draw(x, torch.full((3,), u, dtype=torch.float64))
        for row, tok in enumerate(tokens.tolist()):
            assert tok % 2 == 1  # never a removed token, even at the ends of [0, 1)
            cdf = probs[row].cumsum(-1)
            assert cdf[tok] >= u * cdf[-1] - 1e-6 and (tok == 1 or cdf[tok - 2] <= u * cdf[-1])
    # Drawing many uniforms reproduces the distribution: the total variation distance stays
    # within twice what sampling noise alone gives (E|f - p| = sqrt(2 p (1 - p) / (pi N))); a
    # biased generator or an off-by-one draw is far beyond (a shift by one token gives ~1).
    n = 20000
    us = torch.tensor([uniform(7, i) for i in range(n)], dtype=torch.float64)
    row = x[:1].expand(n, -1)
    freq = torch.bincount(draw(row, us), minlength=V).float() / n
    p = probs[0]
    noise = 0.5 * (2 * p * (1 - p) / (math.pi * n)).sqrt().sum()
    assert (freq - p).abs().sum() / 2 < 2 * noise


@pytest.mark.parametrize("vocab", [DRAW_BLOCK * 3, DRAW_BLOCK * 5 + 77, 250_880])
def test_two_level_draw_equals_one_scan_of_the_row(vocab):
    g = torch.Generator().manual_seed(vocab)
    n = 64
    x = torch.randn(n, vocab, generator=g) * torch.rand(n, 1, generator=g) * 8
    x[: n // 2].masked_fill_(torch.rand(n // 2, vocab, generator=g) < 0.7, float("-inf"))
    x[3, DRAW_BLOCK:] = float("-inf")  # all mass in the first block
    x[4, : vocab - 5] = float("-inf")  # all mass in the last five tokens
    x[5, DRAW_BLOCK - 1 : DRAW_BLOCK + 1] = 30.0  # two tokens either side of a block edge
    cdf = x.softmax(-1).double().cumsum(-1)
    rows = torch.arange(n)
    for _ in range(8):
        u = torch.rand(n, generator=g, dtype=torch.float64)
        got = draw(x, u)
        # the sums' order differs: a draw may move only where u sits within rounding of a
        # boundary between two tokens, which fresh uniforms do not hit
        assert torch.equal(got, one_scan_draw(x, u)), (got != one_scan_draw(x, u)).nonzero()
    for end in (0.0, 1 - 2**-53):  # the ends of [0, 1): a valid token, within rounding
        u = torch.full((n,), end, dtype=torch.float64)
        got = draw(x, u)
        assert torch.isfinite(x[rows, got]).all()  # never a removed token
        at = u * cdf[:, -1]
        assert (cdf[rows, got] >= at - 1e-12).all()
        assert (torch.where(got > 0, cdf[rows, (got - 1).clamp(min=0)], 0.0) <= at + 1e-12).all()


@pytest.mark.parametrize("vocab", [7, DRAW_BLOCK, DRAW_BLOCK * 2 + 5, 250_880])
def test_prefix_sums_in_blocks_equal_one_scan(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.rand(5, vocab, generator=g, dtype=torch.float64)
    x[1, ::3] = 0
    got = prefix_sums(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, x.cumsum(-1), rtol=1e-12, atol=0)
    assert torch.equal(prefix_sums(x[:, :1]), x[:, :1])


def test_uniform_is_a_function_of_seed_and_index_only():
    a = [uniform(1234, i) for i in range(1000)]
    assert a == [uniform(1234, i) for i in range(1000)]
    assert a != [uniform(1235, i) for i in range(1000)]
    assert all(0 <= u < 1 for u in a)
    assert abs(sum(a) / len(a) - 0.5) < 0.03
    assert uniform(2**64 - 1, 3) != uniform(0, 3)  # the whole seed range counts


def test_seeded_row_draws_the_same_token_alone_and_in_any_batch():
    """The sampler's token for a seeded row depends on that row's logits, parameters, seed and
    index only: the same alone and inside a batch of 31 others (mixed greedy and sampling)."""
    g = torch.Generator().manual_seed(8)
    sampler = Sampler(slots=32, vocab_size=V, eos_token_id=2, device=torch.device("cpu"))
    target = SamplingParams(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=99)
    rng = random.Random(1)
    for index in range(40):
        row_logits = torch.randn(1, V, generator=g) * 2
        _, alone, _ = sampler.sample(row_logits, [Row(0, target, index)])
        others = [SamplingParams(do_sample=rng.random() < 0.7, temperature=rng.uniform(0.5, 2),
                                 top_p=rng.uniform(0.5, 1), seed=rng.randrange(2**64))
                  for _ in range(31)]  # fmt: skip
        where = rng.randrange(32)
        batch = torch.randn(32, V, generator=g)
        batch[where] = row_logits[0]
        rows = [Row(i + 1, p, index) for i, p in enumerate(others)]
        rows.insert(where, Row(0, target, index))
        _, tokens, _ = sampler.sample(batch, rows)
        assert int(tokens[where]) == int(alone[0])


def test_rows_in_chunks_give_what_one_pass_gives(monkeypatch):
    """The sampler takes a large batch a chunk of rows at a time (its memory stays bounded):
    every row's token and packed outputs are those of one pass over the whole batch, with the
    per-row processors (penalties over the slot's history, logit bias, allowed tokens, EOS held
    back by min_tokens, top-n) landing on their own rows in every chunk."""
    import mpinfer.model.memory as memory

    g = torch.Generator().manual_seed(12)
    rng = random.Random(3)
    kinds = [
        lambda: SamplingParams(),
        lambda: SamplingParams(
            do_sample=True,
            top_p=rng.uniform(0.3, 0.95),
            top_k=40,
            seed=rng.randrange(2**32),
            top_n=3,
        ),
        lambda: SamplingParams(
            do_sample=True,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            seed=rng.randrange(2**32),
            typical_p=0.8,
        ),
        lambda: SamplingParams(logit_bias=((7, 50.0),), top_n=2),
        lambda: SamplingParams(do_sample=True, min_tokens=4, min_p=0.05, seed=5),
        lambda: SamplingParams(allowed_token_ids=(10, 11, 12), do_sample=True, seed=6),
    ]
    n = 13
    params = [kinds[rng.randrange(len(kinds))]().check() for _ in range(n)]
    logits = torch.randn(n, V, generator=g) * 3
    outs = []
    # one pass; 4 rows a pass (the logits bound); 3 rows a pass (server.sampler_rows)
    for chunk, cap, pass_rows in ((None, 0, memory.chunk_rows(V)), (4 * V, 0, 4), (None, 3, 3)):
        if chunk:
            monkeypatch.setattr(memory, "SAMPLER_CHUNK_LOGITS", chunk)
        sampler = Sampler(slots=n, vocab_size=V, eos_token_id=2, device=torch.device("cpu"),
                          rows_cap=cap)  # fmt: skip
        assert sampler.pass_rows == pass_rows
        for i, p in enumerate(params):
            sampler.admit(i, torch.randint(4, V, (30,), generator=torch.Generator().manual_seed(i))
                          .tolist(), p, generated=[9, 9, 20])  # fmt: skip
        rows = [Row(i, p, 2) for i, p in enumerate(params)]
        outs.append((sampler.sample(logits, rows), sampler.counts.clone()))
        monkeypatch.undo()
    assert memory.chunk_rows(V) > n > 3 * 4  # the first sampler took every row in one pass
    (whole, counts_whole) = outs[0]
    for chunked, counts_chunked in outs[1:]:
        for a, b in zip(whole[:2], chunked[:2]):  # slots, tokens
            assert a.tolist() == b.tolist()
        history = [i for i, p in enumerate(params) if p.uses_history]  # counts only these read
        assert history and counts_whole[history].tolist() == counts_chunked[history].tolist()
        for i, p in enumerate(params):  # token, log-probability, finite; the alternatives asked
            cols = [0, 1, 2, *range(3, 3 + p.top_n),
                    *range(3 + MAX_TOP_N, 3 + MAX_TOP_N + p.top_n)]  # fmt: skip
            assert whole[2][i, cols].tolist() == chunked[2][i, cols].tolist(), i


def test_packed_outputs_hold_logprobs_of_the_raw_distribution_and_top_n():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, V, generator=g)
    sampler = Sampler(slots=3, vocab_size=V, eos_token_id=2, device=torch.device("cpu"))
    params = [SamplingParams(top_n=5), SamplingParams(do_sample=True, seed=3, temperature=0.3),
              SamplingParams(top_n=MAX_TOP_N, do_sample=True, seed=4, top_k=5)]  # fmt: skip
    _, tokens, out = sampler.sample(logits, [Row(i, p, 0) for i, p in enumerate(params)])
    logp = logits.log_softmax(-1)
    for i, p in enumerate(params):
        assert int(out[i, 0]) == int(tokens[i]) and out[i, 2] == 1.0
        torch.testing.assert_close(out[i, 1], logp[i, int(tokens[i])])
        k = p.top_n
        top = logp[i].topk(k) if k else None
        if k:
            assert out[i, 3 : 3 + k].long().tolist() == top.indices.tolist()
            torch.testing.assert_close(out[i, 3 + MAX_TOP_N : 3 + MAX_TOP_N + k], top.values)
    assert int(tokens[0]) == int(logits[0].argmax())


def test_a_non_finite_row_is_flagged_and_the_others_are_not():
    logits = torch.randn(3, V)
    logits[1, 7] = float("nan")
    sampler = Sampler(slots=3, vocab_size=V, eos_token_id=2, device=torch.device("cpu"))
    _, _, out = sampler.sample(logits, [Row(i, SamplingParams(do_sample=True, seed=i), 0)
                                        for i in range(3)])  # fmt: skip
    assert out[:, 2].tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "kw, field",
    [({"temperature": -1.0}, "temperature"), ({"temperature": math.inf}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"typical_p": 2.0}, "typical_p"),
     ({"repetition_penalty": 5e-324}, "repetition_penalty"),
     ({"repetition_penalty": 1e9}, "repetition_penalty"), ({"top_k": -1}, "top_k"),
     ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"frequency_penalty": 3.0},
     "frequency_penalty"), ({"stop": ("",)}, "stop"), ({"top_n": 21}, "top_n")],
)  # fmt: skip
def test_parameters_outside_what_the_sampler_computes_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw).check()


def test_extreme_but_valid_parameters_sample_finite_tokens():
    """The smallest temperature is greedy, the smallest top_p keeps one token, the range ends
    of the penalties stay finite: no NaN, no empty distribution."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(10)) * 30
    sampler = Sampler(slots=5, vocab_size=V, eos_token_id=2, device=torch.device("cpu"))
    params = [SamplingParams(do_sample=True, temperature=1e-300, seed=1),
              SamplingParams(do_sample=True, top_p=1e-300, seed=1),
              SamplingParams(do_sample=True, repetition_penalty=0.01, seed=1),
              SamplingParams(do_sample=True, repetition_penalty=100.0, temperature=1e-5, seed=1),
              SamplingParams(do_sample=True, typical_p=1e-300, top_k=1, seed=1)]  # fmt: skip
    for p in params:
        p.check()
    sampler.admit(2, [int(logits[2].argmax())], params[2])
    _, tokens, out = sampler.sample(logits, [Row(i, p, 0) for i, p in enumerate(params)])
    assert out[:, 2].tolist() == [1.0] * 5
    assert int(tokens[0]) == int(logits[0].argmax())  # below MIN_TEMPERATURE: greedy
    assert int(tokens[1]) == int(logits[1].argmax())  # top_p tiny: only the first token is left


class ByteTok:
    """A byte-level tokenizer: one token per UTF-8 byte, as BPE falls back to for rare text."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_split_across_tokens_are_never_broken():
    text = "naïve 東京 😀 ok"
    ids = list(text.encode())
    stream = TextStream(ByteTok())
    deltas = [stream.add(i) for i in ids]
    assert "".join(deltas) + stream.finish() == text
    assert not any("\ufffd" in d for d in deltas)
    # One empty delta per byte that left a character incomplete: ï 1, 東 2, 京 2, 😀 3.
    assert deltas.count("") == 1 + 2 + 2 + 3


def test_a_character_cut_by_the_end_is_the_decoders_replacement_character():
    """As TGI gives it: the final text is the decode of every id, so a cut character shows as
    U+FFFD at the end (the stream held it back until then)."""
    ids = list("ok 東".encode())[:-1]
    stream = TextStream(ByteTok())
    streamed = "".join(stream.add(i) for i in ids)
    streamed += stream.finish()
    assert streamed == stream.text == bytes(ids).decode("utf-8", errors="replace") == "ok \ufffd"


def test_stop_string_text_is_held_back_then_dropped():
    stream = TextStream(ByteTok(), stop=("END", "zz"))
    out = "".join(stream.add(i) for i in b"abc EN")
    assert out == "abc "  # "EN" could start "END": held
    out += stream.add(ord("D"))
    assert stream.stopped and out == "abc " and stream.finish() == "" and stream.text == "abc "


def test_held_text_is_released_when_it_cannot_be_a_stop():
    stream = TextStream(ByteTok(), stop=("END",))
    out = "".join(stream.add(i) for i in b"x ENx")
    assert out == "x ENx" and not stream.stopped
