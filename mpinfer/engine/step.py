"""One engine step as every rank sees it, and how it travels: `Step` (the decode rows, the
prompt chunks and the block-table updates rank 0's scheduler planned), its encoding as integers,
and `StepChannel`, one fixed-size int64 broadcast a step over the gloo group (no pickling on the
step's path). The kinds: STEP runs the forward, IDLE keeps the other ranks' waits short, STOP
ends their loops, FIT sizes the KV pool (runner.fit_cache). What is not here: planning a step
(scheduler.py), running it (runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dist import DistContext

STEP, IDLE, STOP, FIT = 1, 2, 3, 4


@dataclass(frozen=True)
class CacheFit:
    """How `fit_cache` sizes the KV pool on a GPU: the process's whole footprint (nvidia-smi's
    number) stays under `budget` bytes with `margin` to spare; at most `cap` blocks (0: none)."""

    budget: int
    margin: int
    cap: int = 0


@dataclass(frozen=True)
class Prefill:
    slot: int
    start: int  # cache position of the chunk's first token
    tokens: tuple[int, ...]
    sample: bool = False  # the prompt's last chunk: its last logits are sampled
    logprobs: int = -1  # >= 0: every position's log-probabilities (and this many alternatives)
    next_token: int = -1  # the prompt token after the chunk (its last position's target)


@dataclass(frozen=True)
class Step:
    """One engine step, identical on every rank."""

    kind: int = STEP
    decode_slots: tuple[int, ...] = ()
    decode_pos: tuple[int, ...] = ()
    prefills: tuple[Prefill, ...] = ()
    table: tuple[int, ...] = ()  # (row, index, block) triples for the block tables first


def encode_step(step: Step) -> list[int]:
    """A step as integers: [kind, n_decode, n_prefill, n_tokens, n_table, decode slots, decode
    positions, per prefill (slot, start, length, sample, logprobs, next_token), tokens, table
    triples]."""
    tokens = [t for p in step.prefills for t in p.tokens]
    fields = [f for p in step.prefills for f in (p.slot, p.start, len(p.tokens), int(p.sample),
                                                 p.logprobs, p.next_token)]  # fmt: skip
    return [step.kind, len(step.decode_slots), len(step.prefills), len(tokens), len(step.table),
            *step.decode_slots, *step.decode_pos, *fields, *tokens, *step.table]  # fmt: skip


def decode_step_message(data: list[int]) -> Step:
    """`encode_step`'s inverse (trailing integers are ignored)."""
    kind, n_dec, n_pf, n_tok, n_tab = data[:5]
    body = data[5:]
    slots, pos, body = body[:n_dec], body[n_dec : 2 * n_dec], body[2 * n_dec :]
    fields, tokens = body[: 6 * n_pf], body[6 * n_pf : 6 * n_pf + n_tok]
    prefills, at = [], 0
    for i in range(n_pf):
        slot, start, length, sample, logprobs, next_token = fields[6 * i : 6 * i + 6]
        prefills.append(Prefill(slot, start, tuple(tokens[at : at + length]), bool(sample),
                                logprobs, next_token))  # fmt: skip
        at += length
    table = body[6 * n_pf + n_tok : 6 * n_pf + n_tok + n_tab]
    return Step(kind, tuple(slots), tuple(pos), tuple(prefills), tuple(table))


class StepChannel:
    """Steps from rank 0 to the other ranks, as `encode_step`'s integers in one fixed-size int64
    tensor (gloo, CPU): one broadcast a step."""

    def __init__(self, ctx: DistContext, *, slots: int, max_prefill_tokens: int,
                 max_updates: int):  # fmt: skip
        self.ctx = ctx
        # Decode rows and prefills are at most one per slot; tokens at most max_prefill_tokens;
        # table entries at most max_updates (blocks.BlockManager).
        self.buf = torch.zeros(5 + 8 * slots + max_prefill_tokens + 3 * max_updates,
                               dtype=torch.long)  # fmt: skip

    def send(self, step: Step) -> None:
        if self.ctx.world_size == 1:
            return
        data = encode_step(step)
        self.buf[: len(data)] = torch.tensor(data, dtype=torch.long)
        dist.broadcast(self.buf, src=0, group=self.ctx.weights_group)

    def receive(self) -> Step:
        dist.broadcast(self.buf, src=0, group=self.ctx.weights_group)
        return decode_step_message(self.buf.tolist())
