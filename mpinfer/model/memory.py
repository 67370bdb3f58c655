"""The GPU memory planner: what one rank holds, and how many KV-cache tokens fit beside it.

`plan_memory` counts, per rank, what the sharding specs put on each GPU (int8 weights, scales,
embeddings, biases and norms), a CUDA context reserve, the activation workspace, the sampler's
per-slot state and the captured decode graphs, and how many KV-cache tokens fit in what is left.
`mpinfer plan` prints it (`plan_table` for many GPU sizes at once), start-up refuses a model
that cannot fit before loading anything (`check_fits`), and `kv_slots` sizes the engine's cache
from the memory that is actually free once the weights are in. What is not here: host RAM
(hostmem.py), and the check of these numbers against a real GPU (tools/memcheck.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import psutil
import torch

from ..config import RunConfig, parse_bytes
from ..dist import DistContext, broadcast_object, gather_objects
from .attention import KVCache
from .bloom import BloomShape, LoadedModel
from .sharding import rank_entries, specs_for

log = logging.getLogger("mpinfer")

GIB = 2**30
# What the CUDA context, cuBLAS/NCCL workspaces and the allocator's slack take per GPU before a
# single weight is placed (a conservative figure: 0.5-0.9 GiB measured across recent drivers).
CONTEXT_RESERVE = int(0.75 * GIB)
# Free GPU memory the KV cache leaves for what start-up allocates after it: Triton's autotuner
# times kernels beside a 256 MiB cache-flush buffer, cuBLAS makes its workspaces on first use.
RUNTIME_HEADROOM = 2**30
# Prompt log-probabilities go through the LM head this many positions at a time (runner.py).
PROMPT_LOGPROB_ROWS = 64
# GPU sizes `mpinfer plan` answers for when not told one, as the driver reports them (a 24 GB
# RTX 3090/4090 has 24 GiB, an A100 40 or 80 GiB, an L40S 45 GiB, an H200 140 GiB).
COMMON_GPUS = ("16GiB", "24GiB", "40GiB", "48GiB", "80GiB", "140GiB")


def decode_buckets(slots: int) -> list[int]:
    """Batch sizes with a captured decode graph: powers of two below `slots`, and `slots`."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


@dataclass(frozen=True)
class OffloadPlan:
    """Blocks whose weights live in pinned host memory (model/offload.py), spread over the
    layers so that each copy overlaps the blocks before it; `depth` of them on the GPU at once.
    The transfer unit is one block: even bloom-7b1's 200 MB block copies at the full host-to-GPU
    speed, so grouping blocks would only take memory from the resident ones."""

    offloaded: tuple[int, ...]
    depth: int
    block_bytes: int  # one block's weights on one rank
    model_bytes: int = 0  # every weight on one rank, resident or not (what a step reads)
    flops_per_token: int = 0  # a decode token's matmul work on one rank

    @property
    def host_bytes(self) -> int:
        return len(self.offloaded) * self.block_bytes

    def copy_ms(self, host_gbps: float) -> float:
        """The transfer floor: a step copies every offloaded block in once."""
        return self.host_bytes / (host_gbps * 1e9) * 1e3

    def compute_ms(self, batch: int, gpu_tbps: float, gpu_tflops: float) -> float:
        """A step's own work, as if every weight were resident: read each weight once, and the
        batch's matmuls."""
        return (self.model_bytes / (gpu_tbps * 1e12)
                + batch * self.flops_per_token / (gpu_tflops * 1e12)) * 1e3  # fmt: skip

    def predict_ms(self, batch: int, host_gbps: float, gpu_tbps: float,
                   gpu_tflops: float) -> float:  # fmt: skip
        """The copies overlap the compute: a step takes the longer of the two."""
        return max(self.copy_ms(host_gbps), self.compute_ms(batch, gpu_tbps, gpu_tflops))

    def compute_bound_from(self, host_gbps: float, gpu_tbps: float, gpu_tflops: float) -> int:
        """The batch from which a step's compute outlasts its copies."""
        spare = self.copy_ms(host_gbps) - self.compute_ms(0, gpu_tbps, gpu_tflops)
        per = self.compute_ms(1, gpu_tbps, gpu_tflops) - self.compute_ms(0, gpu_tbps, gpu_tflops)
        return max(1, math.ceil(spare / per)) if per > 0 else 1

    def lines(self, n_layer: int, host_gbps: float, gpu_tbps: float = 0.9,
              gpu_tflops: float = 80.0) -> list[str]:  # fmt: skip
        at = f"at {host_gbps:g} GB/s host-to-GPU, {gpu_tbps:g} TB/s and {gpu_tflops:g} TFLOP/s"
        out = [
            f"{'blocks in host memory':<28}{len(self.offloaded):8d} of {n_layer}",
            f"{'host memory pinned per rank':<28}{self.host_bytes / GIB:8.2f} GiB",
            f"{'blocks in flight (ring)':<28}{self.depth:8d}",
            f"{'copy time a step':<28}{self.copy_ms(host_gbps):8.1f} ms (the floor of a step)",
        ]
        for b in (1, 32):
            ms = self.predict_ms(b, host_gbps, gpu_tbps, gpu_tflops)
            out.append(f"{f'step at batch {b}':<28}{ms:8.1f} ms, {b / ms * 1e3:.1f} tok/s")
        most = self.compute_bound_from(host_gbps, gpu_tbps, gpu_tflops)
        out.append(f"{'compute-bound from batch':<28}{most:8d}")
        return out + [f"(estimates {at}: --host-gbps, --gpu-tbps, --gpu-tflops; a step costs "
                      f"about the same for up to {most} tokens, decode rows and prompt tokens "
                      "together: raise server.max_batch_slots and max_prefill_tokens toward it "
                      "as memory allows)"]  # fmt: skip


def spread(n: int, n_layer: int) -> list[int]:
    """n of n_layer block indices, evenly spaced (a copy then overlaps resident blocks)."""
    return sorted({int((k + 0.5) * n_layer / n) for k in range(n)}) if n else []


def block_bytes(shape: BloomShape, cfg: RunConfig, tp_size: int) -> int:
    """One block's weights on one rank, from the sharding specs."""
    dtype = torch.float32 if cfg.model.dtype == "float32" else torch.float16
    total = 0
    for spec in specs_for(shape, tp_size, cfg.quant.method, cfg.quant.embeddings):
        if spec.name.startswith("h.0."):
            total += sum(math.prod(shp) * dt.itemsize
                         for _, shp, dt in rank_entries(spec, tp_size, dtype))  # fmt: skip
    return total


def plan_offload(shape: BloomShape, cfg: RunConfig, *, tp_size: int,
                 budget: int | None) -> OffloadPlan | None:  # fmt: skip
    """model.offload_blocks N > 0: N blocks; -1 (auto): as few as let one max_seq_len sequence
    fit beside the weights under `budget` (None when everything fits, or on a CPU); 0: none.
    A budget too small even with every block in host memory is refused with the numbers."""
    m = cfg.model
    if m.offload_blocks == 0 or (m.offload_blocks < 0 and budget is None):
        return None
    blk = block_bytes(shape, cfg, tp_size)
    depth = max(1, m.offload_depth)
    plan = plan_memory(shape, cfg, tp_size=tp_size, budget=budget or 0)
    h = shape.hidden_size
    flops = 2 * (12 * h * h * shape.n_layer + h * shape.vocab_size) // tp_size
    if m.offload_blocks > 0:
        n = min(m.offload_blocks, shape.n_layer)
    else:
        if plan.fits or cfg.quant.method == "llm.int8":
            return None
        over = plan.one_slot - budget  # what has to leave the GPU, plus the ring it needs
        n = -(-over // blk) + depth
        if n > shape.n_layer:
            least = plan.one_slot - shape.n_layer * blk + depth * blk
            raise ValueError(
                f"does not fit even with every block in host memory: needs {least / GIB:.2f} GiB "
                f"per GPU (embeddings, workspace, {depth} blocks in flight of "
                f"{blk / GIB:.2f} GiB and one {plan.max_seq_len}-token KV sequence), has "
                f"{budget / GIB:.2f} GiB"
            )
    return OffloadPlan(tuple(spread(n, shape.n_layer)), min(depth, n), blk, plan.weights, flops)


def with_offload(plan: MemoryPlan, off: OffloadPlan | None) -> MemoryPlan:
    """`plan` with the offloaded blocks' weights off the GPU and the ring's on it."""
    if off is None:
        return plan
    items = {**plan.items,
             f"blocks in host memory ({len(off.offloaded)})": -off.host_bytes,
             f"offload ring ({off.depth} blocks)": off.depth * off.block_bytes}  # fmt: skip
    return dataclasses.replace(plan, items=items, offload=off)


def check_host_memory(off: OffloadPlan | None, *, ranks: int | None = None,
                      available: int | None = None) -> None:  # fmt: skip
    """Refuse, before loading, an offload plan whose pinned host memory the host lacks: every
    one of `ranks` (default: the ranks on this host) pins its own share, out of `available`
    bytes (default: what this host has available now)."""
    if off is None:
        return
    ranks = ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    have = psutil.virtual_memory().available if available is None else available
    need = off.host_bytes * ranks + GIB
    if need > have:
        raise ValueError(
            f"not enough host memory to hold the offloaded blocks: needs {need / GIB:.1f} GiB "
            f"({len(off.offloaded)} blocks x {off.block_bytes / GIB:.2f} GiB x {ranks} ranks + 1 "
            f"GiB), {have / GIB:.1f} GiB available; raise model.memory_budget or tp"
        )


@dataclass(frozen=True)
class MemoryPlan:
    tp_size: int
    items: dict  # name -> bytes per rank
    kv_bytes_per_token: int
    budget: int
    max_seq_len: int
    block_size: int = 16
    max_sequences: int = 32  # server.max_batch_slots: the cap on sequences at once
    offload: OffloadPlan | None = None  # blocks whose weights stay in host memory

    @property
    def fixed(self) -> int:
        return sum(self.items.values())

    @property
    def kv_tokens(self) -> int:
        return max(0, (self.budget - self.fixed) // self.kv_bytes_per_token)

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // self.block_size

    @property
    def slots(self) -> int:
        """Sequences of max_seq_len at once (what the static layout of one slot per sequence
        would allow)."""
        return self.sequences(self.max_seq_len)

    def sequences(self, tokens: int) -> int:
        """Sequences of `tokens` (prompt + output) that fit in the cache at once, and the cap."""
        per = -(-tokens // self.block_size)
        return min(self.kv_blocks // per, self.max_sequences)

    @property
    def fits(self) -> bool:
        return self.kv_blocks * self.block_size >= self.max_seq_len

    @property
    def one_slot(self) -> int:
        """Bytes per GPU for the weights, the workspace and one max_seq_len KV slot."""
        return self.fixed + self.kv_bytes_per_token * self.max_seq_len

    @property
    def weights(self) -> int:
        return sum(
            v
            for k, v in self.items.items()
            if k.startswith(("weights", "scales", "embeddings", "biases"))
        )

    def lines(self, request: tuple[int, int] = (512, 256)) -> list[str]:
        """The table `mpinfer plan` prints; `request` (prompt, output) tokens of the sequences
        it counts."""
        out = [f"{name:<28}{nbytes / GIB:8.2f} GiB" for name, nbytes in self.items.items()]
        out += [
            f"{'total before KV cache':<28}{self.fixed / GIB:8.2f} GiB",
            f"{'budget per GPU':<28}{self.budget / GIB:8.2f} GiB",
            f"{'KV cache per token':<28}{self.kv_bytes_per_token / 2**20:8.3f} MiB",
            f"{'KV cache tokens that fit':<28}{self.kv_tokens:8d}",
            f"{'KV blocks of ' + str(self.block_size) + ' tokens':<28}{self.kv_blocks:8d}",
            f"{'sequences of ' + f'{request[0]}+{request[1]}':<28}"
            f"{self.sequences(sum(request)):8d}",
            f"{'sequences of max_seq_len=' + str(self.max_seq_len):<28}{self.slots:8d}",
        ]
        if self.sequences(sum(request)) == self.max_sequences:
            out.append(f"(capped by server.max_batch_slots={self.max_sequences})")
        return out


def plan_memory(shape: BloomShape, cfg: RunConfig, *, tp_size: int, budget: int) -> MemoryPlan:
    """Per-rank device bytes of the model `cfg` describes, from the sharding specs."""
    dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
    quant = cfg.quant.method != "none"
    items = {"weights (int8)": 0, "scales": 0, "embeddings and LM head": 0,
             "biases and norms": 0}  # fmt: skip
    largest = 0
    dense_key = f"weights ({cfg.model.dtype})"
    for spec in specs_for(shape, tp_size, cfg.quant.method, cfg.quant.embeddings):
        rank_shape = spec.rank_shape(tp_size)
        n, rows = math.prod(rank_shape), rank_shape[0]
        if spec.name.startswith("word_embeddings."):
            items["embeddings and LM head"] += n * (1 if spec.quantize else dtype_bytes)
            items["scales"] += rows * 4 if spec.quantize else 0
        elif spec.quantize:
            items["weights (int8)"] += n
            items["scales"] += rows * 4
            largest = max(largest, n)
        elif len(spec.shape) == 2:  # quant = none: the block weights in the compute dtype
            items[dense_key] = items.get(dense_key, 0) + n * dtype_bytes
        else:
            items["biases and norms"] += n * dtype_bytes
    if not quant:
        del items["weights (int8)"], items["scales"]
    h, v = shape.hidden_size, shape.vocab_size
    s = cfg.server
    slots = s.max_batch_slots
    logit_rows = max(slots, PROMPT_LOGPROB_ROWS)
    workspace = (
        largest * dtype_bytes  # the dequantized weight of a prefill matmul
        + s.max_prefill_tokens * 8 * h // tp_size * dtype_bytes * 2  # prefill activations
        + s.max_prefill_tokens * h * dtype_bytes  # a prefill chunk's final hidden states
        + logit_rows * v * (dtype_bytes + 4 * 3)  # gathered logits, their fp32 copy, two temps
    )
    items["CUDA context reserve"] = CONTEXT_RESERVE
    items["activation workspace"] = workspace
    # The sampler keeps, per slot, which tokens the prompt holds and how often each was generated.
    items["sampler state"] = slots * v * (1 + 4)
    if s.cuda_graphs:
        # Every bucket's graph leaves its hidden states and logits in two shared buffers; the
        # shared pool holds one step's activations.
        most = slots + s.max_prefill_tokens
        items["step graphs"] = (slots * v + most * h) * dtype_bytes + slots * 16 * h * 4
    act = torch.float32 if dtype_bytes == 4 else torch.float16
    kv = KVCache.bytes_per_token(shape, tp_size, act, quantized=s.kv_cache_dtype == "int8")
    return MemoryPlan(tp_size, items, kv, budget, s.max_seq_len,
                      min(s.kv_block_size, s.max_seq_len), slots)  # fmt: skip


def suggest(shape: BloomShape, cfg: RunConfig, *, tp_size: int, budget: int) -> str:
    """A way out when the model does not fit: a larger tp size, or int8."""
    for tp in range(tp_size + 1, 65):
        if shape.n_head % tp == 0 and plan_memory(shape, cfg, tp_size=tp, budget=budget).fits:
            return f"try tp={tp}"
    if cfg.quant.method == "none":
        return "try quant.method=int8"
    return "use GPUs with more memory"


def plan_table(shape: BloomShape, cfg: RunConfig, *, budgets: list[tuple[str, int]],
               tp_sizes: list[int], request=(512, 256)) -> list[dict]:  # fmt: skip
    """One row per (GPU size, tp size): fits or not, weights per GPU, KV tokens that fit, and
    sequences at once of `request` (prompt, output) tokens and of max_seq_len."""
    rows = []
    for label, budget in budgets:
        for tp in tp_sizes:
            plan = plan_memory(shape, cfg, tp_size=tp, budget=budget)
            rows.append({"gpu": label, "tp": tp, "fits": plan.fits, "weights": plan.weights,
                         "total": plan.fixed, "kv_tokens": plan.kv_tokens,
                         "sequences": plan.sequences(sum(request)),
                         "slots": plan.slots})  # fmt: skip
    return rows


def tp_sizes_for(shape: BloomShape, most: int = 8) -> list[int]:
    """Tensor-parallel sizes this model can run: those that divide its heads, up to `most`."""
    return [tp for tp in range(1, most + 1) if shape.n_head % tp == 0]


def budget_bytes(cfg: RunConfig, device: torch.device) -> int | None:
    """The per-rank device budget: model.memory_budget, else the GPU's memory (None on CPU)."""
    if cfg.model.memory_budget:
        return parse_bytes(cfg.model.memory_budget, "model.memory_budget")
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_fits(shape: BloomShape, cfg: RunConfig, *, tp_size: int, device) -> MemoryPlan | None:
    """Refuse, before anything is loaded, a model whose weights leave no room for one sequence
    even with blocks offloaded to host memory (or with offloading off), or whose offloaded
    blocks the host cannot hold. The plan, with its offload if any (None on a CPU without
    model.offload_blocks)."""
    budget = budget_bytes(cfg, device)
    off = plan_offload(shape, cfg, tp_size=tp_size, budget=budget)
    check_host_memory(off)
    if budget is None:
        return None if off is None else with_offload(
            plan_memory(shape, cfg, tp_size=tp_size, budget=0), off)  # fmt: skip
    plan = with_offload(plan_memory(shape, cfg, tp_size=tp_size, budget=budget), off)
    if not plan.fits:
        raise ValueError(
            f"does not fit: needs {plan.one_slot / GIB:.2f} GiB per GPU (weights and workspace "
            f"{plan.fixed / GIB:.2f} GiB + one {plan.max_seq_len}-token KV slot), has "
            f"{budget / GIB:.2f} GiB; {suggest(shape, cfg, tp_size=tp_size, budget=budget)}"
        )
    return plan


def kv_cache_size(loaded: LoadedModel, cfg: RunConfig, ctx: DistContext, *,
                  rows: int | None = None) -> tuple[int, int]:  # fmt: skip
    """(rows, blocks) of the engine's KV cache: blocks of server.kv_block_size tokens in the
    memory actually free once the weights are in (every rank agrees on the smallest), at most
    server.kv_cache_tokens; on a CPU rows x max_seq_len tokens unless that key says. Rows (the
    sequences at once) are max_batch_slots, fewer if not even that many blocks fit. An error if
    one max_seq_len sequence does not fit. A collective: every rank calls it at the same point
    of start-up."""
    s = cfg.server
    rows = rows or s.max_batch_slots
    bs = min(s.kv_block_size, s.max_seq_len)
    per_row = -(-s.max_seq_len // bs)
    fit = s.kv_cache_tokens // bs if s.kv_cache_tokens else rows * per_row
    if loaded.device.type == "cuda":
        free = torch.cuda.mem_get_info(loaded.device)[0]
        budget = budget_bytes(cfg, loaded.device)
        used = torch.cuda.memory_allocated(loaded.device)
        # What is free now, less what start-up allocates after the cache (Triton's autotuner
        # takes a 256 MiB buffer, cuBLAS its workspaces), and within the budget.
        free = min(free - RUNTIME_HEADROOM, budget - used - CONTEXT_RESERVE)
        plan = plan_memory(loaded.shape, cfg, tp_size=loaded.tp.tp_size, budget=budget)
        beside = sum(plan.items.get(k, 0) for k in ("activation workspace", "sampler state",
                                                     "step graphs"))  # fmt: skip
        room = max(0, free - beside) // (plan.kv_bytes_per_token * bs)
        fit = min(fit, room) if s.kv_cache_tokens else room
    fits = gather_objects(fit, ctx)
    fit = broadcast_object(min(fits) if ctx.is_rank0 else None, ctx)
    if fit * bs < s.max_seq_len:
        raise ValueError(f"no room for a KV cache of one max_seq_len={s.max_seq_len} sequence "
                         f"({fit} blocks of {bs} tokens fit): lower server.max_seq_len, raise "
                         "tp or server.kv_cache_tokens")  # fmt: skip
    if fit < rows and ctx.is_rank0:
        log.warning("server.max_batch_slots=%d: only %d KV blocks fit, so at most %d sequences",
                    rows, fit, fit)  # fmt: skip
    if ctx.is_rank0:
        log.info("KV cache: %d blocks of %d tokens (%d tokens), up to %d sequences at once",
                 fit, bs, fit * bs, min(rows, fit))  # fmt: skip
    return min(rows, fit), fit
