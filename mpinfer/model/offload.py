"""Blocks whose weights live in host memory: a model larger than the GPU budget runs, each such
block's weights copied in just before it computes, while earlier blocks compute.

    the offloaded blocks      their parameters are host tensors in one HostArena (page-locked
                              on a GPU host), never on the GPU whole
    the ring                  `depth` GPU copies of one block's structure; copies go into its
                              slots round robin, in the order the blocks run
    a step                    after offloaded block k computes (`done`), the block `depth`
                              offloaded blocks later is copied into its slot; past the last
                              block this wraps to the next step's first blocks, so their copies
                              overlap the end of this step and the host's work between steps

On a GPU the copies run on a side stream: the copy into a slot waits (an event) until the block
that used the slot has computed, and the compute stream waits (an event) until the slot holds
the block it runs. Nothing waits on the host, and weights are never copied back (they are
read-only). On a CPU the copies are plain host-to-host copies, with the same schedule and
bookkeeping, so the CPU tests run this code. With `depth` at least the number of offloaded blocks
the ring holds them all after the first step and copies nothing more.

What is not here: which blocks and how deep (offloadplan.plan_offload), putting the loaded slices in
the arena (checkpoint/loader.py).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn


class HostArena:
    """One host allocation that every offloaded tensor of a rank is carved from. On a GPU host
    it is page-locked once (cudaHostRegister), so copies from it are asynchronous DMA: exactly
    the bytes asked for, where torch's pinned allocator rounds each tensor up to a power of two
    (a 617 MB weight would pin 1 GiB)."""

    ALIGN = 256

    def __init__(self, nbytes: int, *, pin: bool):
        self.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.used = 0
        self.pinned = False
        if pin:
            # cudaHostRegister straight from torch's CUDA runtime bindings.
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory "
                                   f"for the offloaded blocks (CUDA error {int(err)})")  # fmt: skip
            self.pinned = True

    @staticmethod
    def size_for(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Bytes an arena needs for tensors of these (shape, dtype), alignment included."""
        a = HostArena.ALIGN
        return sum(-(-math.prod(s) * d.itemsize // a) * a for s, d in shapes)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor carved from the arena."""
        n = math.prod(shape) * dtype.itemsize
        start = -(-self.used // self.ALIGN) * self.ALIGN
        if start + n > self.buf.numel():
            raise RuntimeError(f"host arena full: {start + n} of {self.buf.numel()} bytes "
                               "(the offload plan and the loaded tensors disagree)")  # fmt: skip
        self.used = start + n
        return self.buf[start : start + n].view(dtype).view(shape)

    def close(self) -> None:
        if self.pinned:
            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())

    def __del__(self):
        # At interpreter exit torch's CUDA bindings may already be torn down; the process's
        # exit releases the page lock then anyway.
        with contextlib.suppress(Exception):
            self.close()


class Offload:
    def __init__(self, blocks: nn.ModuleList, offloaded: list[int], depth: int,
                 device: torch.device, arena: HostArena | None = None):  # fmt: skip
        self.order = sorted(offloaded)
        self.index = {b: k for k, b in enumerate(self.order)}
        self.depth = max(1, min(depth, len(self.order)))
        self.is_cuda = device.type == "cuda"
        self.arena = arena  # keeps the host weights (and their page lock) alive
        self.host = {b: list(blocks[b].parameters()) for b in self.order}
        # The ring: a block's structure on the device, its weights overwritten by each copy. Its
        # layers share the model's tensor-parallel group (a process group is not copied).
        template = blocks[self.order[0]]
        shared = {id(m.tp): m.tp for m in template.modules() if hasattr(m, "tp")}
        for p in template.parameters():  # deepcopy must not copy the arena the weights view
            shared[id(p)] = torch.empty(0)
        self.ring = [copy.deepcopy(template, dict(shared)) for _ in range(self.depth)]
        for m, params in zip(self.ring, self._ring_tensors(template, device)):
            _set_params(m, params)
        self.ring_params = [list(m.parameters()) for m in self.ring]
        self.holds: list[int | None] = [None] * self.depth  # the block each slot holds
        self.slot: dict[int, int] = {}  # block -> the slot holding it
        self.next_slot = 0  # copies fill the slots round robin, in the order blocks run
        self.block_bytes = sum(p.numel() * p.element_size() for p in self.host[self.order[0]])
        self.copies = 0
        if self.is_cuda:
            self.stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(self.depth)]
            self.free = [torch.cuda.Event() for _ in range(self.depth)]

    def measure(self) -> float:
        """GB/s of one offloaded block's copy into the ring, timed on the GPU (0 on a CPU): what
        start-up reports a step's copies will cost. Leaves the ring empty."""
        if not self.is_cuda:
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # the first copy warms the path up
                start.record(self.stream)
                for dst, src in zip(self.ring_params[0], self.host[self.order[0]]):
                    dst.data.copy_(src.data, non_blocking=True)
                end.record(self.stream)
        end.synchronize()
        self.holds = [None] * self.depth
        self.slot.clear()
        return self.block_bytes / (start.elapsed_time(end) / 1e3) / 1e9

    def _ring_tensors(self, template: nn.Module, device: torch.device):
        names = [n for n, _ in template.named_parameters()]
        for _ in range(self.depth):
            yield {n: torch.empty_like(p, device=device) for n, p in
                   zip(names, template.parameters())}  # fmt: skip

    def __contains__(self, block: int) -> bool:
        return block in self.index

    def start_step(self) -> None:
        """Make sure the first `depth` offloaded blocks are in or on their way (the previous
        step has usually fetched them already)."""
        for b in self.order[: self.depth]:
            self._fetch(b)

    def _fetch(self, b: int) -> None:
        if b in self.slot:
            return
        j = self.next_slot
        self.next_slot = (j + 1) % self.depth
        if self.is_cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.free[j])  # the slot's last block has computed
                for dst, src in zip(self.ring_params[j], self.host[b]):
                    dst.data.copy_(src.data, non_blocking=True)
                self.ready[j].record(self.stream)
        else:
            for dst, src in zip(self.ring_params[j], self.host[b]):
                dst.data.copy_(src.data)
        self.slot.pop(self.holds[j], None)
        self.holds[j], self.slot[b] = b, j
        self.copies += 1

    def block(self, b: int) -> nn.Module:
        """The module that runs offloaded block `b`, its weights in place (in stream order)."""
        j = self.slot.get(b)
        assert j is not None, f"block {b} was not fetched (the ring holds {self.holds})"
        if self.is_cuda:
            torch.cuda.current_stream().wait_event(self.ready[j])
        return self.ring[j]

    def done(self, b: int) -> None:
        """Block `b` has been launched: its slot is free once it computes; fetch the block
        `depth` offloaded blocks later (wrapping to the next step's first) into it."""
        if self.is_cuda:
            self.free[self.slot[b]].record()
        k = (self.index[b] + self.depth) % len(self.order)
        self._fetch(self.order[k])


def _set_params(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        parent, _, attr = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, attr, nn.Parameter(t, requires_grad=False))
