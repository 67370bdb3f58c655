"""Blocks in host memory, planned: which blocks' weights stay in pinned host memory when a
model is over its GPU budget, how many are on the GPU at once, and the step time that buys
(`OffloadPlan`); with the budget planned for throughput (`plan_for_throughput`): an offloaded
step costs its copies at any batch until compute outlasts them, so the budget goes to KV room
and rows rather than to resident blocks. `check_fits` is start-up's refusal, before loading, of
a model that cannot fit even so. What is not here: the copies themselves (offload.py), the rest
of the memory plan (memory.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import psutil
import torch

from ..config import RunConfig, ServerConfig
from .bloom import BloomShape
from .kernels import DEQUANT_ROWS
from .memory import GIB, MemoryPlan, budget_bytes, plan_memory, suggest
from .sharding import rank_entries, specs_for

log = logging.getLogger("mpinfer")


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
    for spec in specs_for(shape, tp_size, cfg.quant):
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
        need = offloaded_one_slot(shape, cfg, tp_size=tp_size)
        n = max(1, -(-(need - budget) // blk)) + depth  # what has to leave, and the ring
        if n > shape.n_layer:
            least = need - shape.n_layer * blk + depth * blk
            raise ValueError(
                f"does not fit even with every block in host memory: needs {least / GIB:.2f} GiB "
                f"per GPU (embeddings, workspace, {depth} blocks in flight of "
                f"{blk / GIB:.2f} GiB and one {plan.max_seq_len}-token KV sequence), has "
                f"{budget / GIB:.2f} GiB; {fit_hints(shape, cfg, tp_size, budget, least)}"
            )
    return OffloadPlan(tuple(spread(n, shape.n_layer)), min(depth, n), blk, plan.weights, flops)


def offloaded_one_slot(shape: BloomShape, cfg: RunConfig, *, tp_size: int) -> int:
    """Bytes per GPU for the whole model and one max_seq_len sequence, counted as a model with
    blocks in host memory runs: its sampler passes over fewer rows and its steps are eager (no
    graphs), which for a small model with a large vocabulary is most of what it needs."""
    off_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, offload_blocks=1))
    plan = plan_memory(shape, off_cfg, tp_size=tp_size, budget=0)
    return plan.one_slot - plan.items.get("step graphs", 0)


def fit_hints(shape: BloomShape, cfg: RunConfig, tp_size: int, budget: int, least: int) -> str:
    """What would make a refused budget work: the smallest budget, and each of the options that
    fits this one (int8 embeddings, an int8 KV cache, a shorter max_seq_len, int4 weights, fewer
    rows a step)."""
    q, s = cfg.quant, cfg.server
    tries = []
    if q.embeddings != "int8" and q.method != "llm.int8":
        tries.append(('quant.embeddings="int8"', {"quant": {"embeddings": "int8"}}))
    if s.kv_cache_dtype != "int8":
        tries.append(('server.kv_cache_dtype="int8"', {"server": {"kv_cache_dtype": "int8"}}))
    for seq in (1024, 512):
        if s.max_seq_len > seq:
            tries.append((f"server.max_seq_len={seq}", {"server": {"max_seq_len": seq}}))
            break
    if q.method == "int8":
        tries.append(('quant.method="int4"', {"quant": {"method": "int4"}}))
    if s.max_batch_slots > 16:  # the sampler's pass and the logits grow with the rows
        tries.append(("server.max_batch_slots=16", {"server": {"max_batch_slots": 16}}))
    works = []
    for text, change in tries:
        trial = dataclasses.replace(cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kv)
                                            for sec, kv in change.items()})  # fmt: skip
        try:
            plan_offload(shape, trial, tp_size=tp_size, budget=budget)
        except ValueError:
            continue
        works.append(text)
    hint = f"a budget of {least / GIB:.2f} GiB would do"
    return hint + (f", or this one with {' or '.join(works)}" if works else "")


def with_offload(plan: MemoryPlan, off: OffloadPlan | None) -> MemoryPlan:
    """`plan` with the offloaded blocks' weights off the GPU and the ring's on it."""
    if off is None:
        return plan
    items = {**plan.items,
             f"blocks in host memory ({len(off.offloaded)})": -off.host_bytes,
             f"offload ring ({off.depth} blocks)": off.depth * off.block_bytes}  # fmt: skip
    items.pop("step graphs", None)  # offloaded steps run eagerly (runner.py)
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
            f"GiB), {have / GIB:.1f} GiB available on this host; raise model.memory_budget or "
            "tp (`mpinfer plan --host-mem SIZE` plans for another machine's RAM)"
        )


def check_fits(shape: BloomShape, cfg: RunConfig, *, tp_size: int, device,
               host: bool = True) -> MemoryPlan | None:  # fmt: skip
    """Refuse, before anything is loaded, a model whose weights leave no room for one sequence
    even with blocks offloaded to host memory (or with offloading off), or (`host`) whose
    offloaded blocks this host cannot hold. The plan, with its offload if any (None on a CPU
    without model.offload_blocks)."""
    budget = budget_bytes(cfg, device)
    off = plan_offload(shape, cfg, tp_size=tp_size, budget=budget)
    if host:
        check_host_memory(off)
    if off is not None and cfg.model.offload_blocks < 0:  # counted as the offloaded model runs
        model = dataclasses.replace(cfg.model, offload_blocks=len(off.offloaded))
        cfg = dataclasses.replace(cfg, model=model)
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


# What the throughput plan assumes of the traffic: rows for as many sequences of this many
# tokens as the KV cache holds (a short prompt and its answer; longer ones are admitted by free
# blocks as always, and preempted when the blocks run out), at most this many rows a step.
PLANNED_SEQUENCE = 128
MAX_PLANNED_ROWS = 256
# Host-to-GPU copy speed and GPU rates the plan assumes before the loader measures the copies
# (PCIe 4.0 x16 and a consumer GPU: conservative for an H200's 55 GB/s, 4.3 TB/s, 790 TFLOP/s).
PLAN_HOST_GBPS, PLAN_GPU_TBPS, PLAN_GPU_TFLOPS = 25.0, 0.9, 80.0


@dataclass(frozen=True)
class ThroughputPlan:
    blocks: int  # offloaded
    rows: int  # sequences a step carries (max_batch_slots)
    prefill_tokens: int  # max_prefill_tokens
    kv_int8: bool
    kv_tokens: int
    embeddings_int8: bool
    step_ms: float  # predicted, at `rows`
    tok_s: float

    def lines(self, host_gbps: float) -> list[str]:
        return [f"{'throughput plan':<28}{self.blocks:8d} blocks in host memory, "
                f"{self.rows} rows, {self.prefill_tokens} prompt tokens a step, "
                f"{'int8' if self.kv_int8 else 'model-dtype'} KV ({self.kv_tokens} tokens), "
                f"{'int8' if self.embeddings_int8 else 'model-dtype'} embeddings: "
                f"a step of {self.rows} rows {self.step_ms:.1f} ms, {self.tok_s:.0f} tok/s at "
                f"{host_gbps:g} GB/s"]  # fmt: skip


def plan_for_throughput(shape: BloomShape, cfg: RunConfig, *, tp_size: int, budget: int | None,
                        **rates) -> tuple[RunConfig, ThroughputPlan | None]:  # fmt: skip
    """`_plan_for_throughput` (below), with quant.embeddings="auto" decided: a model over its
    budget gets int8 embeddings and LM head where they make it fit with every block on the GPU,
    or where the plan with them predicts at least EMBEDDINGS_GAIN more tokens/s (bloom-7b1 at
    6 GiB: the fp16 embedding is 1.9 GiB of the budget, int8 halves it, and the KV cache gets
    the rest: 106 rows a step instead of 75), or where nothing else fits at all; otherwise they
    stay in the compute dtype. The returned config names the choice; a config that names
    quant.embeddings keeps it."""
    if cfg.quant.embeddings != "auto" or cfg.quant.method == "llm.int8":
        return _plan_for_throughput(shape, cfg, tp_size=tp_size, budget=budget, **rates)
    plans, refused = {}, None
    for emb in ("none", "int8"):
        trial = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, embeddings=emb))
        try:
            plans[emb] = _plan_for_throughput(shape, trial, tp_size=tp_size, budget=budget,
                                              **rates)  # fmt: skip
        except ValueError as e:  # too big even with every block in host memory
            refused = refused or e
            plans[emb] = None
    if plans["int8"] is None:
        raise refused
    if plans["none"] is None:  # only int8 embeddings fit at all
        return plans["int8"]
    (plain, slow), (small, fast) = plans["none"], plans["int8"]
    if slow is None:  # fits as it is (or cannot be planned): nothing to decide
        return cfg, None
    if fast is None:  # int8 embeddings alone make room for every block (if it fits at all)
        off = plan_offload(shape, small, tp_size=tp_size, budget=budget)
        fits = plan_memory(shape, small, tp_size=tp_size, budget=budget).fits
        return (small, None) if off is None and fits else (plain, slow)
    return (small, fast) if fast.tok_s >= slow.tok_s * EMBEDDINGS_GAIN else (plain, slow)


# What int8 embeddings must buy before "auto" chooses them over the compute dtype's (their
# logits round differently, so a few percent is not worth it).
EMBEDDINGS_GAIN = 1.1


def _plan_for_throughput(shape: BloomShape, cfg: RunConfig, *, tp_size: int, budget: int | None,
                         host_bytes: int | None = None, host_gbps: float = PLAN_HOST_GBPS,
                         gpu_tbps: float = PLAN_GPU_TBPS, gpu_tflops: float = PLAN_GPU_TFLOPS
                         ) -> tuple[RunConfig, ThroughputPlan | None]:  # fmt: skip
    """A model over its budget with model.offload_blocks = -1: the config that maximizes
    tokens/s for the budget, and the plan. An offloaded step costs its copies at any batch
    until compute outlasts them, so each block moved to host memory costs a copy but gives its
    memory to the KV cache (more rows a step); the plan tries every block count from the least
    that fits to every block (as far as the host can pin, `host_bytes` for this host's ranks),
    rows = the sequences of PLANNED_SEQUENCE tokens the cache holds (at most the batch from
    which a step is compute-bound, and MAX_PLANNED_ROWS), and keeps the fastest. It sets the
    KV cache to int8 (unless server.kv_cache_dtype says "model"), max_batch_slots to the rows
    and max_prefill_tokens to what keeps a step at 256 tokens, unless the config set them.
    Unchanged: a model that fits, or a config that names its offload_blocks."""
    if cfg.model.offload_blocks != -1 or budget is None or cfg.quant.method == "llm.int8":
        return cfg, None
    least = plan_offload(shape, cfg, tp_size=tp_size, budget=budget)
    if least is None:
        return cfg, None
    s, default = cfg.server, ServerConfig()
    kv_int8 = s.kv_cache_dtype in ("auto", "int8")
    server = dataclasses.replace(s, kv_cache_dtype="int8" if kv_int8 else "model")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    pinnable = host_bytes if host_bytes is not None else psutil.virtual_memory().available
    can_pin = (pinnable - GIB) // max(1, least.block_bytes * ranks)
    most = min(shape.n_layer, max(len(least.offloaded), can_pin))
    # Rows and prompt tokens a step: the config's where it sets them, else the plan's.
    cap = s.max_batch_slots if s.max_batch_slots != default.max_batch_slots else MAX_PLANNED_ROWS
    fixed_prefill = s.max_prefill_tokens != default.max_prefill_tokens

    def prefill_for(rows: int) -> int:
        # Prompt tokens a step: what keeps the step at DEQUANT_ROWS tokens (measured on the
        # H200: 2,048 a step held 1.9 GiB of transient activations and a dequantized weight,
        # which the KV cache then lacked), at least 64.
        return s.max_prefill_tokens if fixed_prefill else max(64, DEQUANT_ROWS - rows)

    def planned(n: int, rows: int) -> tuple[MemoryPlan, OffloadPlan]:
        trial = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, offload_blocks=n),
            server=dataclasses.replace(server, max_batch_slots=rows,
                                       max_prefill_tokens=prefill_for(rows)))  # fmt: skip
        off = plan_offload(shape, trial, tp_size=tp_size, budget=budget)
        return with_offload(plan_memory(shape, trial, tp_size=tp_size, budget=budget), off), off

    best = None
    for n in range(len(least.offloaded), most + 1):
        plan, off = planned(n, 1)
        bound = off.compute_bound_from(host_gbps, gpu_tbps, gpu_tflops)
        # The most rows whose own plan (the sampler and logits grow with the rows, the KV cache
        # shrinks) holds a PLANNED_SEQUENCE for each, up to the compute bound: a binary search,
        # as the room per row only falls as the rows grow.
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if min(planned(n, mid)[0].kv_tokens // PLANNED_SEQUENCE, bound) >= mid:
                lo = mid
            else:
                hi = mid - 1
        rows = lo
        if rows < 1:
            continue
        plan, off = planned(n, rows)
        if not plan.fits:
            continue
        step = off.predict_ms(rows, host_gbps, gpu_tbps, gpu_tflops)
        cand = ThroughputPlan(n, rows, prefill_for(rows), kv_int8, plan.kv_tokens,
                              cfg.quant.embeddings == "int8", step, rows / step * 1e3)  # fmt: skip
        if best is None or cand.tok_s > best.tok_s * 1.001:  # ties: fewer blocks offloaded
            best = cand
    if best is None:
        return cfg, None
    server = dataclasses.replace(server, max_batch_slots=best.rows,
                                 max_prefill_tokens=best.prefill_tokens)  # fmt: skip
    model = dataclasses.replace(cfg.model, offload_blocks=best.blocks)
    return dataclasses.replace(cfg, model=model, server=server), best
