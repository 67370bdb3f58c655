"""Logits processors against transformers' reference processors on fixed logits, and the
incremental detokenizer on multi-byte characters and stop strings."""

from __future__ import annotations

import pytest
import torch

from mpinfer.detok import TextStream
from mpinfer.generation import SamplingParams, process_logits


@pytest.fixture()
def logits():
    return torch.randn(500, generator=torch.Generator().manual_seed(3)) * 3


def hf_reference(logits, params, seen):
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
    if params.temperature != 1.0:
        x = TemperatureLogitsWarper(params.temperature)(ids, x)
    if params.top_k:
        x = TopKLogitsWarper(params.top_k)(ids, x)
    if params.top_p < 1.0:
        x = TopPLogitsWarper(params.top_p)(ids, x)
    if params.typical_p < 1.0:
        x = TypicalLogitsWarper(params.typical_p)(ids, x)
    return x[0]


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.5},
        {"temperature": 1.7},
        {"top_k": 7},
        {"top_p": 0.6},
        {"typical_p": 0.4},
        {"repetition_penalty": 1.3},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1},
    ],
)
def test_each_processor_matches_transformers(logits, kw):
    params = SamplingParams(do_sample=True, **kw)
    seen = torch.tensor([3, 17, 17, 250, 499])
    ours = process_logits(logits, params, seen)
    ref = hf_reference(logits, params, seen)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = ~torch.isinf(ref)
    torch.testing.assert_close(ours[kept], ref[kept])
    if kw.keys() & {"top_k", "top_p", "typical_p"}:
        assert 0 < kept.sum() < len(logits)  # it did cut the distribution


def test_greedy_applies_only_the_repetition_penalty(logits):
    seen = torch.tensor([int(logits.argmax())])
    out = process_logits(logits, SamplingParams(repetition_penalty=10.0, top_k=1), seen)
    assert int(out.argmax()) != int(logits.argmax()) and not torch.isinf(out).any()


class ByteTok:
    """A byte-level tokenizer: one token per UTF-8 byte, as BPE falls back to for rare text."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_split_across_tokens_are_never_broken():
    text = "naïve 東京 😀 ok"
    ids = list(text.encode())
    stream = TextStream(ByteTok())
    deltas = [stream.add(i) for i in ids]
    assert "".join(deltas) + stream.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    # One empty delta per byte that left a character incomplete: ï 1, 東 2, 京 2, 😀 3.
    assert deltas.count("") == 1 + 2 + 2 + 3


def test_stop_string_text_is_held_back_then_dropped():
    stream = TextStream(ByteTok(), stop=("END", "zz"))
    out = "".join(stream.add(i) for i in b"abc EN")
    assert out == "abc "  # "EN" could start "END": held
    out += stream.add(ord("D"))
    assert stream.stopped and out == "abc "


def test_held_text_is_released_when_it_cannot_be_a_stop():
    stream = TextStream(ByteTok(), stop=("END",))
    out = "".join(stream.add(i) for i in b"x ENx")
    assert out == "x ENx" and not stream.stopped
