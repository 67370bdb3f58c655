"""Blocks whose weights live in host memory: a model larger than the GPU budget runs, each such
block's weights copied in just before it computes, while earlier blocks compute.

    the offloaded blocks      their parameters are (pinned) host tensors, never on the GPU whole
    the ring                  `depth` GPU copies of one block's structure; offloaded block k (in
                              layer order) runs in slot k % depth
    a step                    start_step copies the first `depth` offloaded blocks in; after
                              offloaded block k computes (`done`), block k + depth is copied
                              into its slot

On a GPU the copies run on a side stream from pinned memory: the copy into a slot waits (an
event) until the block that used the slot has computed, and the compute stream waits (an event)
until the slot holds the block it runs. Nothing waits on the host, and weights are never copied
back (they are read-only). On a CPU the copies are plain host-to-host copies, with the same
schedule and bookkeeping, so the CPU tests run this code. With `depth` at least the number of
offloaded blocks the ring holds them all after the first step and copies nothing more.

What is not here: which blocks and how deep (memory.plan_offload), putting the loaded slices in
host memory (checkpoint/loader.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class Offload:
    def __init__(self, blocks: nn.ModuleList, offloaded: list[int], depth: int,
                 device: torch.device):  # fmt: skip
        self.order = sorted(offloaded)
        self.slot_of = {b: k for k, b in enumerate(self.order)}
        self.depth = max(1, min(depth, len(self.order)))
        self.is_cuda = device.type == "cuda"
        self.host = {b: list(blocks[b].parameters()) for b in self.order}
        # The ring: a block's structure on the device, its weights overwritten by each copy. Its
        # layers share the model's tensor-parallel group (a process group is not copied).
        template = blocks[self.order[0]]
        shared = {id(m.tp): m.tp for m in template.modules() if hasattr(m, "tp")}
        self.ring = [copy.deepcopy(template, dict(shared)).to(device) for _ in range(self.depth)]
        self.ring_params = [list(m.parameters()) for m in self.ring]
        self.holds: list[int | None] = [None] * self.depth  # the block each slot holds
        self.block_bytes = sum(p.numel() * p.element_size() for p in self.host[self.order[0]])
        self.copies = 0
        if self.is_cuda:
            self.stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(self.depth)]
            self.free = [torch.cuda.Event() for _ in range(self.depth)]

    def __contains__(self, block: int) -> bool:
        return block in self.slot_of

    def start_step(self) -> None:
        """Copy the first `depth` offloaded blocks in (those the ring does not hold already)."""
        for b in self.order[: self.depth]:
            self._fetch(b)

    def _fetch(self, b: int) -> None:
        j = self.slot_of[b] % self.depth
        if self.holds[j] == b:
            return
        if self.is_cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.free[j])  # the slot's last block has computed
                for dst, src in zip(self.ring_params[j], self.host[b]):
                    dst.data.copy_(src.data, non_blocking=True)
                self.ready[j].record(self.stream)
        else:
            for dst, src in zip(self.ring_params[j], self.host[b]):
                dst.data.copy_(src.data)
        self.holds[j] = b
        self.copies += 1

    def block(self, b: int) -> nn.Module:
        """The module that runs offloaded block `b`, its weights in place (in stream order)."""
        j = self.slot_of[b] % self.depth
        assert self.holds[j] == b, f"block {b} was not fetched (slot {j} holds {self.holds[j]})"
        if self.is_cuda:
            torch.cuda.current_stream().wait_event(self.ready[j])
        return self.ring[j]

    def done(self, b: int) -> None:
        """Block `b` has been launched: its slot is free once it computes; fetch the block
        `depth` offloaded blocks later into it."""
        k = self.slot_of[b]
        if self.is_cuda:
            self.free[k % self.depth].record()
        if k + self.depth < len(self.order):
            self._fetch(self.order[k + self.depth])
