"""load_model(): a meta model on every rank, real weights by assignment.

The rank-0 path (an HF checkpoint): rank 0 reads config.json and checks the checkpoint against
it, then all ranks agree (or all raise the same error). Every rank builds the model on the meta
device. Rank 0 walks the sharding specs tensor by tensor, reads only each rank's slice,
quantizes it, and sends rank r exactly its slice over the gloo `weights` group; replicated
tensors are broadcast. At most two slices are in flight on rank 0 (one being sent, the next
being read), so host RAM grows with the largest slice, not with the model. Each rank copies
what it receives to its device and drops the host buffer.

The sharded path (a directory `mpinfer shard` wrote): each rank checks the manifest and its own
file (sharded.py's checks), the ranks agree on every error, then each reads its own file to its
device. What is not here: the sharded format itself (sharded.py), which tensor is split how
(sharding.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from ..config import RunConfig
from ..dist import DistContext, broadcast_object, gather_objects
from ..model.bloom import DTYPES, BloomModel, BloomShape, LoadedModel
from ..model.layers import TPGroup
from ..model.memory import budget_bytes
from ..model.offload import HostArena, Offload
from ..model.offloadplan import OffloadPlan, check_fits, check_host_memory, plan_for_throughput
from ..model.quant import make_linear_method
from ..model.sharding import ShardSpec, rank_entries, shard_tensor, specs_for
from . import sharded
from .hf import HFCheckpoint, inspect_checkpoint
from .hostmem import HostMemoryMonitor, return_large_frees_to_os

log = logging.getLogger("mpinfer")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_tp_size(cfg: RunConfig, world_size: int) -> int:
    tp = cfg.parallel.tp_size or world_size
    if tp != world_size:
        raise ValueError(
            f"parallel.tp_size={tp} does not match the world size {world_size} "
            "(torchrun --nproc-per-node); mpinfer runs one tensor-parallel group over all ranks"
        )
    return tp


def build_meta_model(shape: BloomShape, tp: TPGroup, cfg: RunConfig, dtype) -> BloomModel:
    """The whole model on the meta device: shapes and dtypes only, no memory, no init."""
    method = make_linear_method(cfg.quant.method, threshold=cfg.quant.threshold,
                                group_size=cfg.quant.group_size)  # fmt: skip
    emb_method = make_linear_method("int8" if cfg.quant.embeddings == "int8" else "none")
    with torch.device("meta"):
        return BloomModel(shape, tp, method=method, embedding_method=emb_method, dtype=dtype)


def planned(model: nn.Module, name: str, tensor: torch.Tensor):
    """(module, attribute) of the meta parameter `name`, once `tensor` is checked against it:
    a ValueError naming the tensor when the model has no such parameter or the shape or dtype
    differ (a checked error, not an assertion: it must hold under python -O too)."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
        old = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"tensor {name}: the model has no such parameter") from None
    if old.shape != tensor.shape or old.dtype != tensor.dtype:
        raise ValueError(f"tensor {name}: the plan is {tuple(old.shape)} {old.dtype}, the "
                         f"checkpoint gives {tuple(tensor.shape)} {tensor.dtype}")  # fmt: skip
    return module, attr


def assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the meta parameter `name` with `tensor` (already on the device), checked."""
    module, attr = planned(model, name, tensor)
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def offload_of(plan) -> OffloadPlan | None:
    return plan.offload if plan is not None else None


def placement(off: OffloadPlan | None, device: torch.device, model: BloomModel):
    """Where each loaded tensor goes: an offloaded block's into one host arena (page-locked on
    a GPU host), straight from the slice it came in (host RAM peaks at the offloaded bytes plus
    one slice), the rest to the device. The arena, None without offloading."""
    blocks = set(off.offloaded) if off is not None else set()
    arena = None
    if blocks:
        shapes = [(tuple(p.shape), p.dtype) for b in sorted(blocks)
                  for p in model.h[b].parameters()]  # fmt: skip
        arena = HostArena(HostArena.size_for(shapes), pin=device.type == "cuda")

    def place(name: str, t: torch.Tensor) -> torch.Tensor:
        if blocks and name.startswith("h.") and int(name.split(".")[1]) in blocks:
            host = arena.take(t.shape, t.dtype)
            host.copy_(t)
            return host
        return t.to(device)

    return place, arena


def finish_model(model: BloomModel, device: torch.device, off: OffloadPlan | None = None,
                 arena: HostArena | None = None, rows: int = 0) -> None:  # fmt: skip
    """Check nothing is left on meta, run the per-layer and per-model hooks, and set up the
    offloaded blocks' ring (`off`, their weights in `arena`; `rows`, the sequences a step
    carries, for the logged prediction at the measured copy speed)."""
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{len(left)} tensors the plan needs are not in the checkpoint, e.g. "
                         f"{left[:3]}")  # fmt: skip
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.after_load(module)
    model.after_load(device)
    if off is not None:
        model.offload = Offload(model.h, list(off.offloaded), off.depth, device, arena)
        log.info(
            "%d of %d blocks in host memory (%.2f GiB%s), %d in flight on the device",
            len(off.offloaded),
            len(model.h),
            off.host_bytes / 2**30,
            ", page-locked" if arena is not None and arena.pinned else "",
            model.offload.depth,
        )
        if gbps := model.offload.measure():
            floor = off.copy_ms(gbps)
            log.info("host-to-GPU copies at %.1f GB/s: a step copies %.2f GiB, so it takes at "
                     "least %.0f ms at any batch%s", gbps, off.host_bytes / 2**30, floor,
                     f"; {rows} rows a step: at most {rows / floor * 1e3:.0f} tok/s at this "
                     "speed" if rows else "")  # fmt: skip


def agree_on_model(cfg: RunConfig, ctx: DistContext) -> tuple[BloomShape, int, HFCheckpoint | None]:
    """Rank 0 reads and checks config.json and the checkpoint; every rank gets the verdict."""
    error, config_dict, ckpt = None, None, None
    if ctx.is_rank0:
        try:
            config_dict, _, ckpt = inspect_checkpoint(
                cfg.model.path, resolve_tp_size(cfg, ctx.world_size), cfg.quant
            )
        except ValueError as e:
            error = str(e)
    error, config_dict = broadcast_object((error, config_dict), ctx)
    if error:
        raise ValueError(error)
    shape = BloomShape.from_config(config_dict)
    return shape, resolve_tp_size(cfg, ctx.world_size), ckpt


def _send(t: torch.Tensor, dst: int, ctx: DistContext):
    # Raw bytes: gloo point-to-point does not care about dtype, and int8/bf16 travel as they are.
    return dist.isend(
        t.contiguous().view(torch.uint8).reshape(-1), dst=dst, group=ctx.weights_group
    )


def _recv(shape, dtype, ctx: DistContext) -> torch.Tensor:
    buf = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8)
    dist.recv(buf, src=0, group=ctx.weights_group)
    return buf.view(dtype).reshape(shape)


def _broadcast(t: torch.Tensor | None, shape, dtype, ctx: DistContext) -> torch.Tensor:
    if ctx.world_size == 1:
        return t
    if ctx.is_rank0:
        buf = t.contiguous().view(torch.uint8).reshape(-1)
    else:
        buf = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=ctx.weights_group)
    return buf.view(dtype).reshape(shape)


def _stream_rank0(
    model, specs: list[ShardSpec], ckpt: HFCheckpoint, tp_size, dtype, ctx: DistContext, place
) -> None:
    total = sum(torch.Size(p.shape).numel() for p in specs)
    bar = tqdm(total=total, unit="param", unit_scale=True, desc="loading", mininterval=1.0)
    pending, held = [], None
    for spec in specs:
        if spec.split == "replicate":
            tensors = shard_tensor(spec, ckpt.read(spec.name), tp_size, dtype)
            for name, t in tensors.items():
                assign_tensor(model, name, place(name, _broadcast(t, t.shape, t.dtype, ctx)))
        else:
            for r in range(tp_size):
                rng = spec.rank_range(r, tp_size)
                piece = ckpt.read(spec.name, *rng) if rng else ckpt.read(spec.name)
                # On a GPU, quantize there (much faster); what goes to other ranks returns to
                # host memory as int8, half the bytes of the fp16 source.
                tensors = shard_tensor(spec, piece.to(ctx.device), tp_size, dtype)
                if r > 0:
                    tensors = {k: t.cpu() for k, t in tensors.items()}
                del piece
                for w in pending:  # the previous slice is on its way; now let it go
                    w.wait()
                pending = []
                if r == 0:
                    for name, t in tensors.items():
                        assign_tensor(model, name, place(name, t))
                else:
                    pending = [_send(t, r, ctx) for t in tensors.values()]
                    held = tensors  # keep the buffers alive until their sends complete
        bar.update(torch.Size(spec.shape).numel())
    for w in pending:
        w.wait()
    del held
    bar.close()


def _stream_other(model, specs: list[ShardSpec], tp_size, dtype, ctx: DistContext,
                  place) -> None:  # fmt: skip
    for spec in specs:
        for name, _, _ in rank_entries(spec, tp_size, dtype):
            meta = model.get_parameter(name)
            if spec.split == "replicate":
                t = _broadcast(None, meta.shape, meta.dtype, ctx)
            else:
                t = _recv(meta.shape, meta.dtype, ctx)
            assign_tensor(model, name, place(name, t))


def load_model(cfg: RunConfig, ctx: DistContext) -> LoadedModel:
    """Load `cfg.model.path` onto every rank of `ctx` (an HF checkpoint or a sharded one)."""
    return_large_frees_to_os()
    t0 = time.perf_counter()
    with HostMemoryMonitor() as mem:
        if sharded.is_sharded(cfg.model.path):
            loaded = _load_sharded(cfg, ctx)
        else:
            loaded = _load_from_hf(cfg, ctx)
    return _report(loaded, t0, mem, ctx)


def plan_run(cfg: RunConfig, shape: BloomShape, tp_size: int,
             ctx: DistContext) -> tuple[RunConfig, OffloadPlan | None]:  # fmt: skip
    """The config this run loads with and its offload plan, decided once, on rank 0, and the
    same on every rank: a model over its budget gets the throughput plan
    (offloadplan.plan_for_throughput), then `check_fits` refuses what cannot fit (the same error
    on every rank); each rank checks that its own host can hold the offloaded blocks."""
    error, off = None, None
    if ctx.is_rank0:
        try:
            if ctx.device.type == "cuda":
                cfg, fast = plan_for_throughput(shape, cfg, tp_size=tp_size,
                                                budget=budget_bytes(cfg, ctx.device))  # fmt: skip
                if fast is not None:
                    log.info("over the budget: %s", " ".join(fast.lines(25.0)))
            off = offload_of(check_fits(shape, cfg, tp_size=tp_size, device=ctx.device,
                                        host=False))  # fmt: skip
        except ValueError as e:
            error = str(e)
    error, cfg, off = broadcast_object((error, cfg, off), ctx)
    if error:
        raise ValueError(error)
    check_host_memory(off)
    return cfg, off


def _load_from_hf(cfg: RunConfig, ctx: DistContext) -> LoadedModel:
    shape, tp_size, ckpt = agree_on_model(cfg, ctx)
    cfg, off = plan_run(cfg, shape, tp_size, ctx)
    dtype = resolve_dtype(cfg.model.dtype, ctx.device)
    tp = TPGroup(ctx.rank, tp_size, ctx.compute_group if tp_size > 1 else None)
    model = build_meta_model(shape, tp, cfg, dtype)
    place, arena = placement(off, ctx.device, model)
    specs = specs_for(shape, tp_size, cfg.quant)
    if ctx.is_rank0:
        log.info(
            "loading %s (%.2f GB on disk) with tp=%d, quant=%s, dtype=%s",
            cfg.model.path,
            ckpt.nbytes() / 1e9,
            tp_size,
            cfg.quant.method,
            str(dtype)[6:],
        )
        _stream_rank0(model, specs, ckpt, tp_size, dtype, ctx, place)
    else:
        _stream_other(model, specs, tp_size, dtype, ctx, place)
    finish_model(model, ctx.device, off, arena, cfg.server.max_batch_slots)
    return LoadedModel(model, shape, tp, dtype, ctx.device, cfg.model.path, cfg=cfg)


def _load_sharded(cfg: RunConfig, ctx: DistContext) -> LoadedModel:
    out = Path(cfg.model.path)
    error, manifest = None, None
    try:
        manifest = sharded.read_manifest(out)
        sharded.check_rank(cfg, manifest, out, ctx.rank, ctx.world_size)
    except ValueError as e:
        error = f"rank {ctx.rank}: {e}"
    errors = [e for e in gather_everywhere(error, ctx) if e]
    if errors:
        raise ValueError("; ".join(errors))
    tp_size = manifest["tp_size"]
    shape = BloomShape.from_config(manifest["model_config"])
    if cfg.quant.embeddings == "auto":  # the shards' own: the plan cannot change them
        stored = manifest["quant"]["embeddings"]
        cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, embeddings=stored))
    cfg, off = plan_run(cfg, shape, tp_size, ctx)
    dtype = resolve_dtype(cfg.model.dtype, ctx.device)
    tp = TPGroup(ctx.rank, tp_size, ctx.compute_group if tp_size > 1 else None)
    model = build_meta_model(shape, tp, cfg, dtype)
    place, arena = placement(off, ctx.device, model)
    path = out / sharded.rank_file(ctx.rank, tp_size)
    if ctx.is_rank0:
        log.info("loading sharded %s (tp=%d, %s)", out, tp_size, manifest["quant"]["method"])
    # Offloaded blocks' tensors are read to host memory and stay there.
    device = str(ctx.device) if ctx.device.type == "cuda" and off is None else "cpu"
    error, wanted = None, {n: p.dtype for n, p in model.named_parameters()}
    try:  # a file that passes its checksum can still disagree with the plan: every rank says so
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                # Tensors kept in the compute dtype were written in the source's (or
                # --dtype's); quantized weights and their scales and offsets have their own.
                if t.is_floating_point() and wanted.get(name) == dtype:
                    t = t.to(dtype)
                planned(model, name, t)  # before it is placed anywhere
                assign_tensor(model, name, place(name, t))
        finish_model(model, ctx.device, off, arena, cfg.server.max_batch_slots)
    except ValueError as e:
        error = f"rank file {path}: {e}"
    errors = [e for e in gather_everywhere(error, ctx) if e]
    if errors:
        raise ValueError("; ".join(errors))
    return LoadedModel(model, shape, tp, dtype, ctx.device, str(out), cfg=cfg)


def gather_everywhere(obj, ctx: DistContext) -> list:
    """Every rank's `obj` on every rank (gloo): each rank can raise every rank's error."""
    if ctx.world_size == 1:
        return [obj]
    every = [None] * ctx.world_size
    dist.all_gather_object(every, obj, group=ctx.weights_group)
    return every


def _report(loaded: LoadedModel, t0: float, mem: HostMemoryMonitor, ctx) -> LoadedModel:
    loaded.load_seconds = time.perf_counter() - t0
    rss = gather_objects((mem.start_mib, mem.peak_mib, mem.end_mib), ctx)
    if ctx.is_rank0:
        loaded.host_rss_mib = rss
        per_rank = ", ".join(
            f"rank {r}: peak {peak:.0f} MiB (+{peak - start:.0f} over start, final {end:.0f})"
            for r, (start, peak, end) in enumerate(rss)
        )
        log.info("loaded in %.2f s; anonymous host RAM %s", loaded.load_seconds, per_rank)
    return loaded
