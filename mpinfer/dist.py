"""Process groups: init from the torchrun environment, the two groups, rank-0 logging, teardown.

`compute` carries the model's collectives (NCCL when every rank has a GPU, else gloo);
`weights` is always gloo on CPU tensors: it carries load-time weight transfer and small control
messages (rank 0's decisions), so neither touches GPU memory. Without torchrun's environment
the process is a world of one. What is not here: any model code.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import psutil
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
            store = private_store(rank, world_size, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, device_id=None)  # fmt: skip
        else:
            # A world of one: an in-memory store, no port to pick.
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    compute = dist.new_group(backend="nccl" if use_cuda else "gloo", timeout=timeout)
    weights = dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(rank, world_size, local_rank, dev, compute, weights)


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_interface() -> str | None:
    """The name of the interface that carries 127.0.0.1 (lo on Linux, lo0 on macOS)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def private_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The rendezvous store, listening on MASTER_ADDR alone, never on every interface.

    torch's TCPStore binds its server to all interfaces (`*:port`) whatever address the ranks
    dial, so anyone who reaches the host could write keys into it or disturb the job. Rank 0
    binds the listening socket itself, to MASTER_ADDR (127.0.0.1 for one host, the address the
    user names for several), and hands it to the store. Under torchrun's agent store
    (TORCHELASTIC_USE_AGENT_STORE) the agent owns the store, and the ranks only dial it. For one
    host gloo and NCCL's bootstrap are also kept on the loopback interface (unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if is_loopback(addr) and (lo := loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"the rendezvous port {addr}:{port} cannot be bound: {e.strerror}") from e
    sock.listen(128)
    try:
        store = dist.TCPStore(addr, port, world_size, True, timeout=timeout,
                              master_listen_fd=sock.fileno())  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


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


class SharedError(ValueError):
    """A user error rank 0 found and every rank raises (raise_everywhere): rank 0 says it."""


def raise_everywhere(error: str | None, ctx: DistContext) -> None:
    """Rank 0 found (or did not find) a user error; every rank raises it, so none waits forever."""
    error = broadcast_object(error, ctx)
    if error:
        raise SharedError(error)


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The command line that runs `args` (a script or `-m module`, and its arguments) on `nproc`
    local ranks under torchrun, with this interpreter (benchmarks and tests start jobs this way)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *args]  # fmt: skip
