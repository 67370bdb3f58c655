"""The model runner, on every rank: the KV cache, the captured decode graphs, and the forwards of
one engine step. Rank 0's engine plans a `Step`; every rank runs it here, in the same order, so
the collectives inside the forwards pair up.

    Step: decode rows (slot, position) + prefill chunks (slot, start, tokens)
    decode: each slot's input is the token its last step sampled, kept on the device in
            `next_tokens` (rank 0 writes it after sampling, `share_next_tokens` copies it to
            the other ranks), so the host never waits for a token before the next step
    prefill: eager, one chunk per forward; a prompt's last chunk gives the logits its first
            token is sampled from, and a chunk of a prompt that asked for log-probabilities
            gives every position's logits, `PROMPT_LOGPROB_ROWS` positions at a time

On a GPU the decode step is captured in a CUDA graph per batch-size bucket (1, 2, 4, ... up to
the slots, `memory.decode_buckets`) once the cache exists; a step with n rows replays the
smallest bucket >= n, its other rows marked slot -1, which the kernels skip (they write no cache
and read none). All bucket graphs share one memory pool: they never run at the same time.
With a method that cannot be captured (bitsandbytes) or `server.cuda_graphs = false` the same
bucketed step runs eagerly; on a CPU decode runs eagerly over exactly its rows.

Steps travel from rank 0 as one fixed-size int64 tensor over the gloo group (`StepChannel`):
no pickling on the step's path. What is not here: what to run next (engine.py), sampling
(sampling.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dist import DistContext
from .kernels.tuning import ROW_BUCKETS
from .memory import PROMPT_LOGPROB_ROWS, decode_buckets
from .model import KVCache, LoadedModel, to_device

log = logging.getLogger("mpinfer")

STEP, IDLE, STOP = 1, 2, 3


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


def encode_step(step: Step) -> list[int]:
    """A step as integers: [kind, n_decode, n_prefill, n_tokens, decode slots, decode
    positions, per prefill (slot, start, length, sample, logprobs, next_token), tokens]."""
    tokens = [t for p in step.prefills for t in p.tokens]
    fields = [f for p in step.prefills for f in (p.slot, p.start, len(p.tokens), int(p.sample),
                                                 p.logprobs, p.next_token)]  # fmt: skip
    return [step.kind, len(step.decode_slots), len(step.prefills), len(tokens),
            *step.decode_slots, *step.decode_pos, *fields, *tokens]  # fmt: skip


def decode_step_message(data: list[int]) -> Step:
    """`encode_step`'s inverse (trailing integers are ignored)."""
    kind, n_dec, n_pf, n_tok = data[:4]
    body = data[4:]
    slots, pos, body = body[:n_dec], body[n_dec : 2 * n_dec], body[2 * n_dec :]
    fields, tokens = body[: 6 * n_pf], body[6 * n_pf : 6 * n_pf + n_tok]
    prefills, at = [], 0
    for i in range(n_pf):
        slot, start, length, sample, logprobs, next_token = fields[6 * i : 6 * i + 6]
        prefills.append(Prefill(slot, start, tuple(tokens[at : at + length]), bool(sample),
                                logprobs, next_token))  # fmt: skip
        at += length
    return Step(kind, tuple(slots), tuple(pos), tuple(prefills))


class StepChannel:
    """Steps from rank 0 to the other ranks, as `encode_step`'s integers in one fixed-size int64
    tensor (gloo, CPU): one broadcast a step."""

    def __init__(self, ctx: DistContext, *, slots: int, max_prefill_tokens: int):
        self.ctx = ctx
        # Decode rows and prefills are at most one per slot; tokens at most max_prefill_tokens.
        self.buf = torch.zeros(4 + 8 * slots + max_prefill_tokens, dtype=torch.long)

    def send(self, step: Step) -> None:
        if self.ctx.world_size == 1:
            return
        data = encode_step(step)
        self.buf[: len(data)] = torch.tensor(data, dtype=torch.long)
        dist.broadcast(self.buf, src=0, group=self.ctx.weights_group)

    def receive(self) -> Step:
        dist.broadcast(self.buf, src=0, group=self.ctx.weights_group)
        return decode_step_message(self.buf.tolist())


def group_prefills(prefills, budget: int, max_seq: int) -> list[list[int]]:
    """The step's prompt chunks as batches of one forward each: longest first, a chunk joins a
    batch while the batch padded to its longest chunk stays within `budget` positions and the
    padding stays inside the cache (start + longest <= max_seq)."""
    order = sorted(range(len(prefills)), key=lambda i: -len(prefills[i].tokens))
    groups: list[list[int]] = []
    for i in order:
        p = prefills[i]
        g = groups[-1] if groups else None
        if g is not None:
            T = len(prefills[g[0]].tokens)  # the batch's longest: its first
            if (len(g) + 1) * T <= budget and p.start + T <= max_seq:
                g.append(i)
                continue
        groups.append([i])
    return groups


def warm_up_rows(slots: int) -> list[int]:
    """Row counts a GPU runs once at start-up: the smallest of each int8 kernel row bucket (1,
    2-16, 17-32, 33-64) and every graph bucket, up to `slots`."""
    rows = {1, *(b + 1 for b in ROW_BUCKETS[:-1]), *decode_buckets(slots)}
    return sorted(r for r in rows if r <= slots)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, ctx: DistContext, *, slots: int, max_seq: int,
                 max_prefill_tokens: int = 512, cuda_graphs: bool = True):  # fmt: skip
        self.loaded, self.ctx = loaded, ctx
        self.model, self.device = loaded.model, loaded.device
        self.slots, self.max_seq = slots, max_seq
        self.max_prefill_tokens = max_prefill_tokens
        self.channel = StepChannel(ctx, slots=slots, max_prefill_tokens=max_prefill_tokens)
        self.cache = KVCache.allocate(
            loaded.shape,
            loaded.tp.tp_size,
            slots=slots,
            max_seq=max_seq,
            dtype=loaded.dtype,
            device=self.device,
        )
        # Each slot's next decode input: the token its request sampled last.
        self.next_tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        # The decode step's inputs; a captured graph reads them from these addresses.
        self.dec_slots = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.dec_pos = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.dec_valid_from = torch.zeros(slots, dtype=torch.long, device=self.device)
        methods = [getattr(m, "method", None) for m in self.model.modules()]
        self.use_graphs = (
            cuda_graphs
            and self.device.type == "cuda"
            and all(m.supports_cuda_graphs for m in methods if m is not None)
        )
        # On a GPU a decode step always runs a bucket's batch size, captured or not, so both
        # ways launch the same kernels with the same shapes (CPU: exactly the rows).
        self.buckets = decode_buckets(slots) if self.device.type == "cuda" else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds, self.capture_bytes = 0.0, 0
        if self.device.type == "cuda":
            self._warm_up()
        if self.use_graphs:
            self._capture()

    # -- decode ----------------------------------------------------------------------------------
    def _decode(self, rows: int, kv_len: int) -> torch.Tensor:
        """The decode forward over the first `rows` entries of the static inputs: (rows, V)."""
        slots = self.dec_slots[:rows]
        ids = self.next_tokens[slots.clamp(min=0)][:, None]  # (rows, 1); padding reads slot 0
        return self.model(ids, self.cache, slots=slots, start_pos=self.dec_pos[:rows],
                          valid_from=self.dec_valid_from[:rows], kv_len=kv_len)  # fmt: skip

    def _warm_up(self) -> None:
        """One decode forward per row bucket of the int8 kernels (and per graph bucket) with
        every row padding, and prefills of a few lengths (the few-row kernel's buckets, the
        dequantizing path past 64 rows, the eager attention): Triton compiles and autotunes at
        start-up, not during the first requests (or during a capture). The decodes write no
        cache entry; the prefills write slot 0, which any request's own prefill overwrites
        before it reads."""
        for r in warm_up_rows(self.slots):
            self._decode(r, kv_len=1)
        pad = self.loaded.shape.pad_token_id
        for n in sorted({min(n, self.max_seq) for n in (2, 24, 96)}):
            self._prefill([Prefill(0, 0, (pad,) * n)])
        torch.cuda.synchronize(self.device)

    def _capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # the warm-up's freed blocks would hide what the graphs take
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(decode_buckets(self.slots)):  # largest first: the pool fits all
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._decode(bucket, kv_len=self.max_seq)
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        if self.ctx.is_rank0:
            log.info("captured %d decode graphs (batch %s) in %.2f s, %.0f MiB",
                     len(self.graphs), ", ".join(map(str, sorted(self.graphs))),
                     self.capture_seconds, self.capture_bytes / 2**20)  # fmt: skip

    def bucket(self, rows: int) -> int:
        return next((b for b in self.buckets if b >= rows), rows)

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, step: Step, on_prompt_logits: Callable[..., None] | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """Run `step`; the logits (n, V) of the rows to sample, decode rows first, then each
        prefill with `sample`, in order (None when there are none). For prefills with
        `logprobs` >= 0, `on_prompt_logits(i, offset, logits, targets)` is called (rank 0) per
        run of positions of prefill i: the run's first position in the chunk, logits (r, V)
        and the token each position predicts (-1 past the prompt)."""
        out = []
        n = len(step.decode_slots)
        if n:
            rows = self.bucket(n)
            pad = rows - n
            host = torch.tensor([[*step.decode_slots, *[-1] * pad], [*step.decode_pos, *[0] * pad]])
            self.dec_slots[:rows].copy_(to_device(host[0], self.device), non_blocking=True)
            self.dec_pos[:rows].copy_(to_device(host[1], self.device), non_blocking=True)
            if self.use_graphs:
                graph, logits = self.graphs[rows]
                graph.replay()
                out.append(logits[:n])
            else:
                out.append(self._decode(rows, kv_len=max(step.decode_pos) + 1)[:n])
        last = {}  # prefill index -> its last position's hidden state (to sample from)
        for group in group_prefills(step.prefills, self.max_prefill_tokens, self.max_seq):
            hidden = self._prefill([step.prefills[i] for i in group])  # (rows, T, h)
            for row, i in enumerate(group):
                p = step.prefills[i]
                n = len(p.tokens)
                if p.logprobs >= 0:
                    targets = [*p.tokens[1:], p.next_token]
                    for at in range(0, n, PROMPT_LOGPROB_ROWS):
                        rows = hidden[row, at : min(n, at + PROMPT_LOGPROB_ROWS)]
                        logits = self.model.lm_head(rows)
                        if on_prompt_logits is not None:
                            chunk = targets[at : at + PROMPT_LOGPROB_ROWS]
                            on_prompt_logits(i, at, logits, to_device(chunk, self.device))
                if p.sample:
                    last[i] = hidden[row, n - 1]
        if last:  # one LM head for every prompt that samples, in the step's order
            out.append(self.model.lm_head(torch.stack([last[i] for i in sorted(last)])))
        if not out:
            return None
        return out[0] if len(out) == 1 else torch.cat(out)

    def _prefill(self, prefills: list[Prefill]) -> torch.Tensor:
        """One eager forward over several prompt chunks, right-padded to the longest: (rows, T,
        hidden). A padding position writes the cache past its row's chunk, where nothing reads
        before that row's own later tokens overwrite it (group_prefills keeps it in the cache)."""
        T = max(len(p.tokens) for p in prefills)
        pad = self.loaded.shape.pad_token_id
        ids = to_device([[*p.tokens, *[pad] * (T - len(p.tokens))] for p in prefills], self.device)
        where = to_device([[p.slot for p in prefills], [p.start for p in prefills]], self.device)
        zeros = torch.zeros(len(prefills), dtype=torch.long, device=self.device)
        return self.model(ids, self.cache, slots=where[0], start_pos=where[1], valid_from=zeros,
                          kv_len=max(p.start for p in prefills) + T, output="hidden")  # fmt: skip

    def set_next_tokens(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rank 0, after sampling: each sampled slot's next decode input."""
        self.next_tokens[slots] = tokens

    def share_next_tokens(self) -> None:
        """Every rank, after each step: rank 0's next tokens to the others (on the device, in
        stream order: nobody waits for them on the host)."""
        if self.ctx.world_size > 1:
            dist.broadcast(self.next_tokens, src=0, group=self.ctx.compute_group)


def run_worker(runner: ModelRunner) -> None:
    """Ranks other than 0: run whatever rank 0 plans until it says stop."""
    while True:
        step = runner.channel.receive()
        if step.kind == STOP:
            return
        if step.kind == STEP:
            runner.execute(step)
            runner.share_next_tokens()
