"""The GPU memory planner: what one rank holds, and how many KV-cache tokens fit beside it.

`plan_memory` counts, per rank, what the sharding specs put on each GPU (quantized weights,
scales, embeddings, biases and norms: counted exactly), and estimates what the process holds
beside them (the CUDA context with cuBLAS's and Triton's modules, NCCL's buffers at tp > 1, the
activation workspace, the sampler's per-slot state, the captured step graphs), plus the safety
margin (`model.memory_margin`); the KV cache gets what is left under the budget. `mpinfer plan`
prints it with how each line was obtained (`plan_table` for many GPU sizes at once), and
start-up refuses a model that cannot fit before loading anything (`check_fits`).

On a GPU the estimates only decide whether to start: the engine's KV pool is sized from what
the process really holds (NVML, gpumem.py) after warm-up and graph capture (`fit_blocks`,
runner.py's `fit_cache`), so the budget is the process's whole footprint as nvidia-smi shows
it. What is not here: host RAM (hostmem.py), offload's plan (offloadplan.py), the check of
these numbers against a real GPU (tools/memcheck.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import RunConfig, parse_bytes
from .attention import KVCache
from .bloom import BloomShape
from .kernels import DEQUANT_ROWS
from .kernels.tuning import WORKSPACE_BYTES
from .sharding import rank_entries, specs_for
from .steps import most_tokens

GIB = 2**30
MIB = 2**20
# What the CUDA context with cuBLAS's and Triton's modules and workspaces takes per GPU beside
# torch's tensors (an estimate for planning: 0.5-0.9 GiB measured across recent drivers).
CONTEXT_RESERVE = int(0.75 * GIB)
# NCCL's buffers at tp > 1 (an estimate: its default 4 MiB buffers per channel and peer, for the
# ring and tree channels of up to 8 GPUs; not measured here, the project has run tp > 1 on CPUs
# only).
NCCL_RESERVE = 384 * MIB
# Prompt log-probabilities go through the LM head this many positions at a time (runner.py).
PROMPT_LOGPROB_ROWS = 16
# The sampler takes at most this many logits (rows x vocabulary) per pass (engine/sampling.py's
# Sampler.sample), each costing up to SAMPLER_BYTES_PER_LOGIT of temporaries at the pass's peak
# (float32 copies, the top-p sort's values and int64 order, the float64 CDF; measured on the
# H200: 62.6 bytes with penalties and top-p, 12 greedy). A pass costs the host about 0.7 ms of
# launches whatever its rows (64 rows in 4 passes took 2.9 ms greedy, 8.0 sampled, against 0.8
# and 4.1 in one), so a resident model's chunk is large: 66 rows of BLOOM's vocabulary, about
# 1 GiB at most. With blocks in host memory a step takes 100 ms or more and every MiB is KV
# room: 16 rows, a quarter of the memory for a few ms a step.
SAMPLER_CHUNK_LOGITS = 2**24
OFFLOADED_SAMPLER_CHUNK_LOGITS = 2**22
SAMPLER_BYTES_PER_LOGIT = 64


def chunk_rows(vocab_size: int, *, offloaded: bool = False, cap: int = 0) -> int:
    """Rows per sampler pass: 66 for BLOOM's 250,880 tokens (16 with blocks in host memory), at
    most `cap` (server.sampler_rows) when it is set."""
    most = OFFLOADED_SAMPLER_CHUNK_LOGITS if offloaded else SAMPLER_CHUNK_LOGITS
    rows = max(1, most // vocab_size)
    return min(rows, cap) if cap > 0 else rows


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
class MemoryPlan:
    tp_size: int
    items: dict  # name -> bytes per rank
    kv_bytes_per_token: int
    budget: int
    max_seq_len: int
    block_size: int = 16
    max_sequences: int = 32  # server.max_batch_slots: the cap on sequences at once
    offload: object = None  # offloadplan.OffloadPlan: blocks whose weights stay in host memory

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
        """The table `mpinfer plan` prints (each line with how it was obtained); `request`
        (prompt, output) tokens of the sequences it counts."""
        out = [f"{name:<28}{nbytes / GIB:8.2f} GiB  {how_obtained(name)}"
               for name, nbytes in self.items.items()]  # fmt: skip
        kv = self.kv_blocks * self.block_size * self.kv_bytes_per_token
        out += [
            f"{'total before KV cache':<28}{self.fixed / GIB:8.2f} GiB",
            f"{'KV cache':<28}{kv / GIB:8.2f} GiB",
            f"{'total':<28}{(self.fixed + kv) / GIB:8.2f} GiB  = {(self.fixed + kv) / MIB:,.0f} "
            f"MiB, within the budget",
            f"{'budget per GPU':<28}{self.budget / GIB:8.2f} GiB  = {self.budget / MIB:,.0f} MiB "
            "of the process as nvidia-smi shows it",
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


# How `mpinfer plan` obtains each line (first matching prefix).
HOW = {
    "weights": "counted: the sharding specs", "scales": "counted", "embeddings": "counted",
    "biases": "counted", "sampler state": "counted: a bool and an int32 per slot and token",
    "sampler temporaries": "estimated: one pass over the slots (server.sampler_rows, else at most "
                           "66 rows of BLOOM's vocabulary, 16 offloaded), 64 bytes a logit; "
                           "measured at start-up",
    "CUDA context": "estimated; at start-up the KV pool is sized from what the process holds",
    "NCCL": "estimated (tp > 1); measured at start-up likewise",
    "activation workspace": "estimated: split-K partials, a dequantized weight, activations, "
                            "an eager step's logits",
    "step graphs": "estimated; measured at start-up",
    "safety margin": "model.memory_margin: fragmentation and what warm-up does not reach",
    "blocks in host memory": "counted", "offload ring": "counted",
}  # fmt: skip


def how_obtained(item: str) -> str:
    return next((how for prefix, how in HOW.items() if item.startswith(prefix)), "")


def memory_margin(cfg: RunConfig) -> int:
    return parse_bytes(cfg.model.memory_margin, "model.memory_margin")


def plan_memory(shape: BloomShape, cfg: RunConfig, *, tp_size: int, budget: int) -> MemoryPlan:
    """Per-rank device bytes of the model `cfg` describes, from the sharding specs."""
    dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
    quant = cfg.quant.method != "none"
    wkey = "weights (int4)" if cfg.quant.method == "int4" else "weights (int8)"
    items = {wkey: 0, "scales": 0, "embeddings and LM head": 0, "biases and norms": 0}
    dense_key = f"weights ({cfg.model.dtype})"
    largest = 0
    for spec in specs_for(shape, tp_size, cfg.quant):
        rank_shape = spec.rank_shape(tp_size)
        n, rows = math.prod(rank_shape), rank_shape[0]
        if spec.name.startswith("word_embeddings."):
            items["embeddings and LM head"] += n * (1 if spec.quantize else dtype_bytes)
            items["scales"] += rows * 4 if spec.quantize else 0
        elif spec.quantize:  # int8: a byte and a row scale; int4: half, and fp16 group pairs
            _, *rest = rank_entries(spec, tp_size, torch.float16)
            items[wkey] += n // 2 if spec.quant == "int4" else n
            items["scales"] += sum(math.prod(shp) * dt.itemsize for _, shp, dt in rest)
            largest = max(largest, n)
        elif len(spec.shape) == 2:  # quant = none: the block weights in the compute dtype
            items[dense_key] = items.get(dense_key, 0) + n * dtype_bytes
        else:
            items["biases and norms"] += n * dtype_bytes
    if not quant:
        del items[wkey], items["scales"]
    h, v = shape.hidden_size, shape.vocab_size
    s = cfg.server
    slots = s.max_batch_slots
    # A step of more than DEQUANT_ROWS tokens (a GPU's table may say more) dequantizes one weight
    # at a time (kernels/): counted past the default, whatever the GPU.
    most = most_tokens(slots, s.max_prefill_tokens, s.max_step_tokens)
    dequantized = largest * dtype_bytes if most > DEQUANT_ROWS else 0
    workspace = (
        WORKSPACE_BYTES  # the in-register kernels' split-K partials
        + dequantized
        + s.max_prefill_tokens * 8 * h // tp_size * dtype_bytes * 2  # prefill activations
        + s.max_prefill_tokens * h * dtype_bytes  # a prefill chunk's final hidden states
        + slots * v * dtype_bytes  # the sampled rows' logits of an eager step
    )
    items["CUDA context and libraries"] = CONTEXT_RESERVE
    if tp_size > 1:
        items["NCCL buffers"] = NCCL_RESERVE
    items["activation workspace"] = workspace
    # The sampler keeps, per slot, which tokens the prompt holds and how often each was generated.
    items["sampler state"] = slots * v * (1 + 4)
    # One sampler pass over a chunk of rows, or one run of a prompt's log-probabilities (its
    # logits, their float32 copy, two temporaries): the caching allocator keeps the larger.
    rows = min(slots, chunk_rows(v, offloaded=cfg.model.offload_blocks > 0, cap=s.sampler_rows))
    items["sampler temporaries"] = max(
        rows * v * SAMPLER_BYTES_PER_LOGIT,
        PROMPT_LOGPROB_ROWS * v * (dtype_bytes + 4 * 3),
    )
    if s.cuda_graphs:
        # Every bucket's graph leaves its hidden states and logits in two shared buffers; the
        # shared pool holds one step's activations.
        items["step graphs"] = (slots * v + most * h) * dtype_bytes + slots * 16 * h * 4
    items["safety margin"] = memory_margin(cfg)
    act = torch.float32 if dtype_bytes == 4 else torch.float16
    kv = KVCache.bytes_per_token(shape, tp_size, act, quantized=kv_int8(cfg))
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


def kv_int8(cfg: RunConfig) -> bool:
    """Whether the KV cache is int8: server.kv_cache_dtype "int8" (which "auto" becomes when
    blocks are in host memory: offloadplan.plan_for_throughput)."""
    return cfg.server.kv_cache_dtype == "int8"


def provisional_blocks(cfg: RunConfig, rows: int) -> int:
    """A GPU's first KV pool, before `fit_blocks`: a block for each row and one max_seq_len
    sequence (what warm-up and graph capture need)."""
    s = cfg.server
    return rows + -(-s.max_seq_len // min(s.kv_block_size, s.max_seq_len))


def cpu_blocks(cfg: RunConfig, rows: int) -> int:
    """A CPU's KV pool: server.kv_cache_tokens, else every row can reach max_seq_len."""
    s = cfg.server
    bs = min(s.kv_block_size, s.max_seq_len)
    return s.kv_cache_tokens // bs if s.kv_cache_tokens else rows * -(-s.max_seq_len // bs)


def fit_blocks(*, used: int, free: int, budget: int, margin: int, block_bytes: int,
               current: int, cap: int = 0) -> int:  # fmt: skip
    """The KV pool's blocks from what the process holds now (`used`, its `current` blocks
    included, which the new pool replaces) and what the GPU has `free`: all that stays under
    the budget and the GPU's memory with `margin` to spare, at most `cap` (0: no cap)."""
    room = min(budget - used, free) - margin
    blocks = max(0, current + room // block_bytes)
    return min(blocks, cap) if cap else blocks
