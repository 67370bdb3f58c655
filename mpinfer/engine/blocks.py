"""The KV cache's blocks on rank 0: which block holds which tokens of which sequence, and which
full blocks of earlier prompts can be reused (prefix caching).

    BlockPool     num_blocks blocks of block_size tokens: a reference count per block, a free
                  list, and the prefix cache: full blocks keyed by a hash of every token up to
                  their end, kept while referenced and, once not, in LRU order until a block is
                  needed (a free block is taken first, then the least recently used cached one)
    BlockManager  the pool plus the cache rows: a sequence admitted into row r gets blocks for
                  its whole prompt (the cached ones first), one more block each time its decode
                  crosses a block boundary, and gives them back when it finishes, is cancelled
                  or is preempted. Every change of a row's block table is queued as (row, index,
                  block) and sent to every rank with the next step (runner.py applies it).

A block is registered in the prefix cache once the step that fills it has been launched: steps
run in order on every rank, so a later step that reuses it reads what that one wrote. A request
that asks for prompt log-probabilities computes its whole prompt (they come from the forward).
What is not here: when to admit or preempt (scheduler.py), the cache tensors (attention.py).
"""

from __future__ import annotations

import collections
import hashlib
from array import array


def block_keys(tokens: list[int], block_size: int, salt: str = "") -> list[bytes]:
    """The key of each full block of `tokens`: a hash of the previous block's key and the
    block's tokens, so equal keys mean equal prefixes; a request's `salt` (vLLM's cache_salt)
    starts the chain, so only requests with the same salt share blocks."""
    keys = []
    prev = hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""
    for i in range(len(tokens) // block_size):
        chunk = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def available(self) -> int:
        """Blocks that can be handed out now: free ones and unreferenced cached ones."""
        return len(self.free) + len(self.lru)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    def allocate(self) -> int:
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.lru.popitem(last=False)  # the least recently used cached block
            del self.cached[self.key_of.pop(b)]
        self.ref[b] = 1
        return b

    def take(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.lru[b]
        self.ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} released twice"
            if self.ref[b] == 0:
                if b in self.key_of:
                    self.lru[b] = None  # newest at the end
                else:
                    self.free.append(b)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (no references taken)."""
        out = []
        for key in keys if self.prefix_caching else ():
            b = self.cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, key: bytes, b: int) -> None:
        if self.prefix_caching and key not in self.cached and b not in self.key_of:
            self.cached[key], self.key_of[b] = b, key


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, blocks_per_row: int,
                 prefix_caching: bool = True):  # fmt: skip
        self.pool = BlockPool(num_blocks, block_size, prefix_caching=prefix_caching)
        self.block_size, self.blocks_per_row = block_size, blocks_per_row
        self.updates: list[int] = []  # (row, index, block) triples for the next step
        # A few blocks kept back while sequences run, so that admitting one does not at once
        # force a running one out.
        self.watermark = max(1, num_blocks // 100)
        self.prompt_tokens = self.cached_tokens = self.preemptions = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def admit(self, seq, tokens: list[int], row: int, *, busy: bool) -> bool:
        """Give `seq` (now in `row`) blocks for `tokens`, its prompt (or, after a preemption,
        its prompt and what it generated), reusing cached ones; False when the pool cannot
        hold it now (`busy`: other sequences run, keep the watermark free)."""
        bs = self.block_size
        seq.keys = block_keys(tokens, bs, seq.req.params.cache_salt)
        usable = 0 if seq.req.params.prompt_logprobs >= 0 else (len(tokens) - 1) // bs
        hits = self.pool.lookup(seq.keys[:usable])
        new = self.blocks_for(len(tokens)) - len(hits)
        reclaim = sum(1 for b in hits if self.pool.ref[b] == 0)  # in the LRU, counted available
        if new + reclaim + (self.watermark if busy else 0) > self.pool.available:
            return False
        # A step's message holds a row's worth of table entries for admissions, plus one per
        # decoding row (runner.StepChannel's size): beyond that, the next step admits it.
        if self.updates and len(self.updates) // 3 + len(hits) + new > self.blocks_per_row:
            return False
        for b in hits:
            self.pool.take(b)
        seq.blocks = hits + [self.pool.allocate() for _ in range(new)]
        seq.slot = row
        for i, b in enumerate(seq.blocks):
            self.updates += (row, i, b)
        seq.pos = len(hits) * bs
        seq.prompt_left = list(tokens[seq.pos :])
        self.prompt_tokens += len(tokens)
        self.cached_tokens += seq.pos
        return True

    def grow(self, seq, end: int) -> bool:
        """Blocks for positions [0, end) of `seq`; False when the pool has none left."""
        while len(seq.blocks) * self.block_size < end:
            if not self.pool.available:
                return False
            b = self.pool.allocate()
            self.updates += (seq.slot, len(seq.blocks), b)
            seq.blocks.append(b)
        return True

    def commit(self, seq, start: int = 0) -> None:
        """Register the blocks of `seq` that its planned positions [start, seq.pos) filled
        (blocks of known tokens only)."""
        for i in range(start // self.block_size, min(seq.pos // self.block_size, len(seq.keys))):
            self.pool.register(seq.keys[i], seq.blocks[i])

    def release(self, seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []

    def take_updates(self) -> tuple[int, ...]:
        out, self.updates = tuple(self.updates), []
        return out
