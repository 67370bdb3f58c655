"""The model runner, on every rank: the KV cache, the captured step graphs, and the one forward
of each engine step. Rank 0's engine plans a `Step`; every rank runs it here, in the same order,
so the collectives inside the forward pair up.

    Step: decode rows (slot, position) + prompt chunks (slot, start, tokens)
    one forward: the decode rows and every chunk's tokens in one flat batch (attention.py), so a
            step reads the weights once whatever it carries; a decode row's input is the token
            its last step sampled, kept on the device in `next_tokens` (rank 0 writes it after
            sampling, `share_next_tokens` copies it to the other ranks), so the host never waits
            for a token before the next step
    results: the logits of the rows that sample (decode rows, a prompt's last chunk), and for a
            prompt that asked for log-probabilities every position's logits,
            `PROMPT_LOGPROB_ROWS` positions at a time, from the step's final hidden states

On a GPU every step runs a token-count bucket (`step_buckets`: 1, 2, 4, ... up to the slots,
then powers of two up to the slots plus the prompt budget; or server.step_buckets' list)
captured as a CUDA graph at start-up; a step of n tokens replays the smallest bucket >= n, its
other tokens marked row -1, which the kernels skip (they write no cache and read none; a
padded row still costs the matmuls a row). Warm-up runs every bucket once before the capture,
so every kernel is compiled before the server says ready. All graphs share one memory pool:
they never run at the same time. With a method that cannot be captured (bitsandbytes) or
`server.cuda_graphs = false` the same bucketed step runs eagerly; on a CPU the step runs
eagerly over exactly its tokens, with the reference attention.

Steps travel from rank 0 as one fixed-size int64 tensor over the gloo group (step.py). What is
not here: what to run next (scheduler.py, engine.py), sampling (sampling.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dist import DistContext, broadcast_object, gather_objects
from ..model.attention import FlatBatch, KVCache
from ..model.bloom import LoadedModel, to_device
from ..model.gpumem import free_device_bytes, process_gpu_bytes
from ..model.kernels.tuning import CHUNK_TILE
from ..model.memory import PROMPT_LOGPROB_ROWS, decode_buckets, fit_blocks
from ..model.steps import most_tokens
from .step import FIT, STEP, STOP, CacheFit, Prefill, Step, StepChannel

log = logging.getLogger("mpinfer")


def step_buckets(slots: int, max_prefill_tokens: int, rule: str = "auto",
                 max_step_tokens: int = 0) -> list[int]:  # fmt: skip
    """Token counts with a captured step graph (server.step_buckets), every one up to one
    step's most tokens (steps.most_tokens: decode rows beside a full prompt budget, under the
    step cap), and that most: "auto", the decode buckets (powers of two up to the slots, and
    the slots), then powers of two; or a list "N,N,..." of token counts (a step past the
    largest runs eagerly at its own size)."""
    most = most_tokens(slots, max_prefill_tokens, max_step_tokens)
    if rule != "auto":
        return sorted({b for b in map(int, rule.split(",")) if b < most} | {most})
    out = decode_buckets(slots)
    b = 1 << out[-1].bit_length()
    while b < most:
        out.append(b)
        b *= 2
    return out + ([most] if out[-1] < most else [])


@dataclass(frozen=True)
class Layout:
    """Where a step's tokens go in the flat batch (attention.py): `tokens` decode rows first,
    then each prefill's chunk; `segments` (cache row, first token, count, first position) of
    each decode row and prefill; `sample` the tokens whose logits are sampled, in the order
    `execute` returns them (decode rows, then each sampling prefill's last token)."""

    ids: list[int]  # the input token, -1 where it is the row's last sampled token (next_tokens)
    seq: list[int]
    pos: list[int]
    decode: int
    prefill_at: list[int]  # each prefill's first token
    sample: list[int]

    @classmethod
    def of(cls, step: Step) -> Layout:
        D = len(step.decode_slots)
        ids, seq, pos = [-1] * D, list(step.decode_slots), list(step.decode_pos)
        prefill_at, sample = [], list(range(D))
        for p in step.prefills:
            prefill_at.append(len(ids))
            ids += p.tokens
            seq += [p.slot] * len(p.tokens)
            pos += range(p.start, p.start + len(p.tokens))
            if p.sample:
                sample.append(len(ids) - 1)
        return cls(ids, seq, pos, D, prefill_at, sample)

    def segments(self, step: Step) -> list[tuple[int, int, int, int]]:
        rows = [(s, i, 1, p) for i, (s, p) in enumerate(zip(step.decode_slots, step.decode_pos))]
        return rows + [(p.slot, at, len(p.tokens), p.start)
                       for p, at in zip(step.prefills, self.prefill_at)]  # fmt: skip

    def tiles(self, step: Step) -> list[tuple[int, int, int, int]]:
        """The prompt chunks cut into query tiles of CHUNK_TILE tokens."""
        out = []
        for p, at in zip(step.prefills, self.prefill_at):
            for o in range(0, len(p.tokens), CHUNK_TILE):
                out.append((p.slot, at + o, min(CHUNK_TILE, len(p.tokens) - o), p.start + o))
        return out


@dataclass
class StepInputs:
    """A bucket's device inputs, one int64 buffer a step is copied into (a captured graph reads
    them from these addresses): [ids, from_next, seq, pos] (N each), dec_seq, dec_pos (D each),
    sample (S), tiles (4, T)."""

    buf: torch.Tensor
    n: int
    d: int
    s: int
    t: int

    @classmethod
    def allocate(cls, n: int, slots: int, device) -> StepInputs:
        d = s = min(n, slots)
        t = -(-n // CHUNK_TILE) + min(n, slots)  # a chunk's last tile may be partial
        buf = torch.zeros(4 * n + 2 * d + s + 4 * t, dtype=torch.long, device=device)
        return cls(buf, n, d, s, t)

    def views(self):
        n, d, s, t = self.n, self.d, self.s, self.t
        ids, nxt, seq, pos, rest = self.buf.split([n, n, n, n, 2 * d + s + 4 * t])
        dec_seq, dec_pos, sample, tiles = rest.split([d, d, s, 4 * t])
        return ids, nxt, seq, pos, dec_seq, dec_pos, sample, tiles.view(4, t)

    def host(self, lay: Layout, step: Step, pad: int) -> list[int]:
        """The buffer's contents for `step`: padding tokens are row -1 (they write and read
        nothing), unused tiles count 0 tokens."""
        n, d, s, t = self.n, self.d, self.s, self.t
        k = len(lay.ids)
        fill = n - k
        ids = [pad if i < 0 else i for i in lay.ids] + [pad] * fill
        nxt = list(step.decode_slots) + [-1] * (n - lay.decode)
        tiles = lay.tiles(step)
        cols = [list(c) for c in zip(*tiles)] if tiles else [[], [], [], []]
        tiles_flat = [x for c in cols for x in c + [0] * (t - len(tiles))]
        dec = [*step.decode_slots, *[-1] * (d - lay.decode)]
        dec_pos = [*step.decode_pos, *[0] * (d - lay.decode)]
        sample = lay.sample + [0] * (s - len(lay.sample))
        return [*ids, *nxt, *lay.seq, *[-1] * fill, *lay.pos, *[0] * fill, *dec, *dec_pos,
                *sample, *tiles_flat]  # fmt: skip


class ModelRunner:
    def __init__(self, loaded: LoadedModel, ctx: DistContext, *, slots: int, max_seq: int,
                 max_prefill_tokens: int = 512, cuda_graphs: bool = True, block_size: int = 16,
                 num_blocks: int | None = None, kv_int8: bool = False,
                 fit: CacheFit | None = None, buckets: str = "auto",
                 max_step_tokens: int = 0):  # fmt: skip
        """`slots` cache rows (sequences at once) over `num_blocks` blocks of `block_size`
        tokens (default: every row can reach max_seq at once, the static layout's memory);
        `kv_int8`: keys and values in int8 with a scale per token and head; `fit`: how
        `fit_cache` sizes the pool after warm-up (None: keep num_blocks); `buckets`: the step
        graphs' token counts (step_buckets' rule); `max_step_tokens`: a step's tokens at most
        (steps.py; 0: no cap), which the engine's scheduler keeps to."""
        self.fit, self.kv_int8 = fit, kv_int8
        self.loaded, self.ctx = loaded, ctx
        self.model, self.device = loaded.model, loaded.device
        self.slots, self.max_seq = slots, max_seq
        self.max_prefill_tokens, self.max_step_tokens = max_prefill_tokens, max_step_tokens
        self.block_size = min(block_size, max_seq)
        self.blocks_per_row = -(-max_seq // self.block_size)
        self.num_blocks = num_blocks or slots * self.blocks_per_row
        self.channel = StepChannel(ctx, slots=slots, max_prefill_tokens=max_prefill_tokens,
                                   max_updates=self.blocks_per_row + slots)  # fmt: skip
        self.cache = self._allocate_cache()
        # Each slot's next decode input: the token its request sampled last.
        self.next_tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        methods = [getattr(m, "method", None) for m in self.model.modules()]
        # Offloaded blocks run eagerly: their copies are issued by the host as each step runs.
        self.use_graphs = (
            cuda_graphs
            and self.device.type == "cuda"
            and all(m.supports_cuda_graphs for m in methods if m is not None)
            and self.model.offload is None
        )
        # On a GPU a step always runs a bucket's token count, captured or not, so both ways
        # launch the same kernels with the same shapes (CPU: exactly the step's tokens).
        is_gpu = self.device.type == "cuda"
        self.buckets = (step_buckets(slots, max_prefill_tokens, buckets, max_step_tokens)
                        if is_gpu else [])  # fmt: skip
        self.inputs = {b: StepInputs.allocate(b, slots, self.device) for b in self.buckets}
        h, v = loaded.shape.hidden_size, loaded.shape.vocab_size
        most = self.buckets[-1] if is_gpu else 0
        # Every bucket's step leaves its results here: (tokens, hidden) and (slots, vocab).
        self.hidden = torch.empty((most, h), dtype=loaded.dtype, device=self.device)
        self.logits = torch.empty((min(slots, most), v), dtype=loaded.dtype, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.fitted_bytes = 0  # the process's GPU memory after fit_cache
        self.capture_seconds, self.capture_bytes, self.warm_up_seconds = 0.0, 0, 0.0
        if is_gpu:
            self._warm_up()
        if self.use_graphs:
            self._capture()

    def _allocate_cache(self) -> KVCache:
        return KVCache.allocate(self.loaded.shape, self.loaded.tp.tp_size, slots=self.slots,
                                max_seq=self.max_seq, dtype=self.loaded.dtype, device=self.device,
                                block_size=self.block_size, num_blocks=self.num_blocks,
                                quantized=self.kv_int8)  # fmt: skip

    def fit_cache(self) -> None:
        """Every rank, at one point of start-up (a collective): size the KV pool from what the
        process holds now (warmed up, graphs captured, the engine's sampler made), the pool
        everything under `fit.budget` less `fit.margin`, every rank the smallest pool any rank
        can hold; then reallocate it and capture the graphs again. No-op without `fit`."""
        if self.fit is None or self.device.type != "cuda":
            return
        used, how = process_gpu_bytes(self.device)
        blocks = fit_blocks(used=used, free=free_device_bytes(self.device),
                            budget=self.fit.budget, margin=self.fit.margin,
                            block_bytes=self.cache.bytes_per_block, current=self.num_blocks,
                            cap=self.fit.cap)  # fmt: skip
        blocks = broadcast_object(min(gather_objects(blocks, self.ctx)) if self.ctx.is_rank0
                                  else None, self.ctx)  # fmt: skip
        if blocks * self.block_size < self.max_seq:
            # `used` counts the planner's first pool, which the fitted one replaces
            before = used - self.num_blocks * self.cache.bytes_per_block
            raise ValueError(
                f"no room for a KV cache of one max_seq_len={self.max_seq} sequence under the "
                f"budget of {self.fit.budget / 2**20:,.0f} MiB: the process holds "
                f"{before / 2**20:,.0f} MiB before its cache ({how}), and the cache needs "
                f"{self.max_seq * self.cache.bytes_per_block / self.block_size / 2**20:,.0f} MiB"
                f" more with a margin of {self.fit.margin / 2**20:,.0f} MiB; lower "
                "server.max_seq_len, raise model.memory_budget or tp, or lower "
                "model.memory_margin"
            )
        self.resize_cache(blocks)
        after, how = process_gpu_bytes(self.device)
        if self.ctx.is_rank0:
            log.info("KV cache: %d blocks of %d tokens (%d tokens), up to %d sequences at once; "
                     "the process holds %.0f MiB of its %.0f MiB budget (%s, graphs and "
                     "workspaces included; margin %.0f MiB)", blocks, self.block_size,
                     blocks * self.block_size, min(self.slots, blocks), after / 2**20,
                     self.fit.budget / 2**20, how, self.fit.margin / 2**20)  # fmt: skip
        self.fitted_bytes = after

    def resize_cache(self, num_blocks: int) -> None:
        """A new pool of `num_blocks` blocks (nothing may be running: the old one is gone), and
        the step graphs captured again around it."""
        self.graphs.clear()
        torch.cuda.synchronize(self.device)
        self.cache = None
        torch.cuda.empty_cache()
        self.num_blocks = num_blocks
        self.cache = self._allocate_cache()
        if self.use_graphs:
            self._capture()

    # -- the bucketed GPU step -------------------------------------------------------------------
    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over a bucket's inputs: final hidden states (n, hidden) and the logits of
        its sample rows (s, vocab)."""
        ids, nxt, seq, pos, dec_seq, dec_pos, sample, tiles = inputs.views()
        ids = torch.where(nxt >= 0, self.next_tokens[nxt.clamp(min=0)], ids)
        batch = FlatBatch(seq, pos, dec_seq, dec_pos, tiles)
        hidden = self.model.forward_flat(ids, self.cache, batch)  # (n, hidden)
        return hidden, self.model.lm_head(hidden[sample])

    def _warm_up(self) -> None:
        """Every bucket's step once, eagerly, with every token padding (no cache entry written
        or read): Triton compiles and autotunes every launch shape the engine can run here, at
        start-up, before /health says ready (and before a capture, which cannot compile)."""
        t0 = time.perf_counter()
        for n in self.buckets:
            ids, nxt, seq, pos, dec_seq, dec_pos, sample, tiles = self.inputs[n].views()
            nxt.fill_(-1), seq.fill_(-1), dec_seq.fill_(-1), tiles.zero_()
            self._forward(self.inputs[n])
        torch.cuda.synchronize(self.device)
        self.warm_up_seconds = time.perf_counter() - t0
        if self.ctx.is_rank0:
            log.info("warm-up: %d step shapes (1 to %d tokens) compiled and run in %.1f s",
                     len(self.buckets), self.buckets[-1], self.warm_up_seconds)  # fmt: skip

    def _capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # the warm-up's freed blocks would hide what the graphs take
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.buckets):  # largest first: the pool fits all
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, logits = self._forward(self.inputs[n])
                # Every bucket's results in the same two buffers (read before the next step).
                self.hidden[:n].copy_(hidden)
                self.logits[: logits.shape[0]].copy_(logits)
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        if self.ctx.is_rank0:
            log.info("captured %d step graphs (%s tokens) in %.2f s, %.0f MiB",
                     len(self.graphs), ", ".join(map(str, sorted(self.graphs))),
                     self.capture_seconds, self.capture_bytes / 2**20)  # fmt: skip

    def bucket(self, tokens: int) -> int:
        return next((b for b in self.buckets if b >= tokens), tokens)

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, step: Step, on_prompt_logits: Callable[..., None] | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """Run `step` as one forward over all its tokens; the logits (n, V) of the rows to
        sample, decode rows first, then each prefill with `sample`, in order (None when there
        are none). For prefills with `logprobs` >= 0, `on_prompt_logits(i, offset, logits,
        targets)` is called (rank 0) per run of positions of prefill i: the run's first
        position in the chunk, logits (r, V) and the token each position predicts (-1 past the
        prompt)."""
        if step.table:
            self.cache.apply_updates(step.table)
        lay = Layout.of(step)
        if not lay.ids:
            return None
        if self.device.type == "cuda":
            n = self.bucket(len(lay.ids))
            # A step beyond the buckets (a tool's long prefill) gets inputs of its own, eagerly.
            inputs = self.inputs.get(n) or StepInputs.allocate(n, self.slots, self.device)
            data = inputs.host(lay, step, self.loaded.shape.pad_token_id)
            inputs.buf.copy_(to_device(data, self.device), non_blocking=True)
            if n in self.graphs:
                self.graphs[n].replay()
                hidden, logits = self.hidden, self.logits
            else:
                hidden, logits = self._forward(inputs)
            logits = logits[: len(lay.sample)]
        else:
            hidden, logits = self._forward_exact(lay, step)
        for i, p in enumerate(step.prefills):
            if p.logprobs >= 0:
                self._prompt_logits(i, p, hidden[lay.prefill_at[i] :], on_prompt_logits)
        return logits if len(lay.sample) else None

    def _forward_exact(self, lay: Layout, step: Step):
        """The step over exactly its tokens, with the reference attention (CPU)."""
        nxt = to_device([*step.decode_slots, *[-1] * (len(lay.ids) - lay.decode)], self.device)
        ids = torch.where(nxt >= 0, self.next_tokens[nxt.clamp(min=0)],
                          to_device(lay.ids, self.device))  # fmt: skip
        seq, pos = to_device(lay.seq, self.device), to_device(lay.pos, self.device)
        dec = to_device(step.decode_slots, self.device)
        batch = FlatBatch(seq, pos, dec, to_device(step.decode_pos, self.device),
                          torch.zeros((4, 0), dtype=torch.long), lay.segments(step))  # fmt: skip
        hidden = self.model.forward_flat(ids, self.cache, batch)
        logits = self.model.lm_head(hidden[to_device(lay.sample, self.device)])
        return hidden, logits

    def _prompt_logits(self, i: int, p: Prefill, hidden: torch.Tensor, callback) -> None:
        """Prefill i's logits at every position, PROMPT_LOGPROB_ROWS at a time."""
        n = len(p.tokens)
        targets = [*p.tokens[1:], p.next_token]
        for at in range(0, n, PROMPT_LOGPROB_ROWS):
            logits = self.model.lm_head(hidden[at : min(n, at + PROMPT_LOGPROB_ROWS)])
            if callback is not None:
                chunk = targets[at : at + PROMPT_LOGPROB_ROWS]
                callback(i, at, logits, to_device(chunk, self.device))

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
        elif step.kind == FIT:
            runner.fit_cache()
