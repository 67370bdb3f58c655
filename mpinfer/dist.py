"""Process groups: init from the torchrun environment, the two groups, rank-0 logging, teardown.

`compute` carries the model's collectives (NCCL when every rank has a GPU, else gloo);
`weights` is always gloo on CPU tensors: it carries load-time weight transfer and small control
messages (rank 0's decisions), so neither touches GPU memory. Without torchrun's environment
the process is a world of one. What is not here: any model code.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("mpinfer")


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    compute_group: Any  # a ProcessGroup; Any keeps this importable without dist initialised
    weights_group: Any

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """Exact division, with both numbers in the error (Megatron's `divide`)."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what or numerator}={numerator} is not divisible by tp_size={denominator}"
        )
    return numerator // denominator


def setup_logging(rank: int) -> None:
    """`[rank N]` prefix set once (`[node M rank N]` when the job spans several hosts); ranks
    other than 0 log warnings and errors only."""
    level = os.environ.get("MPINFER_LOG_LEVEL", "INFO" if rank == 0 else "WARNING")
    where = f"rank {rank}"
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world and local_world != os.environ.get("WORLD_SIZE", local_world):
        where = f"node {os.environ.get('GROUP_RANK', '?')} rank {rank}"
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[{where}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def init_distributed(*, timeout_s: float = 600.0, device: str = "auto") -> DistContext:
    """Join the job torchrun started (or make a world of one) and build both groups."""
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    setup_logging(rank)
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=timeout, device_id=None
            )
        else:
            # A world of one: an in-memory store, no port to pick.
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    compute = dist.new_group(backend="nccl" if use_cuda else "gloo", timeout=timeout)
    weights = dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(rank, world_size, local_rank, dev, compute, weights)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank (gloo, CPU): control messages and small metadata."""
    if ctx.world_size == 1:
        return obj
    box = [obj if ctx.is_rank0 else None]
    dist.broadcast_object_list(box, src=0, group=ctx.weights_group)
    return box[0]


def gather_objects(obj: Any, ctx: DistContext) -> list[Any] | None:
    """Every rank's `obj`, as a list on rank 0 (None elsewhere)."""
    if ctx.world_size == 1:
        return [obj]
    out = [None] * ctx.world_size if ctx.is_rank0 else None
    dist.gather_object(obj, out, dst=0, group=ctx.weights_group)
    return out


def raise_everywhere(error: str | None, ctx: DistContext) -> None:
    """Rank 0 found (or did not find) a user error; every rank raises it, so none waits forever."""
    error = broadcast_object(error, ctx)
    if error:
        raise ValueError(error)


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The command line that runs `args` (a script or `-m module`, and its arguments) on `nproc`
    local ranks under torchrun, with this interpreter (benchmarks and tests start jobs this way)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *args]  # fmt: skip
