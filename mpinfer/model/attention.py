"""The KV cache in blocks and attention over it for one engine step's flat batch of tokens: the
model layer's side of the step (the runner builds the batch, the model runs it).

    KVCache: per layer K and V, each (blocks, heads_per_rank, block_size, head_dim), and the block
             table of every cache row, tables (rows, blocks_per_row): position p of row r lives
             at offset p % block_size of block tables[r, p // block_size]

    FlatBatch: a step's tokens in one dimension, decode rows first, then each prompt chunk's
               tokens in order, then padding (row -1) up to the captured bucket's size:

        token:   d0 d1 d2 | c0 c0 c0 c0 c0 | c1 c1 | pad pad ...
        seq:     7  2  5  | 0  0  0  0  0  | 3  3  | -1  -1
        pos:     40 9  17 | 0  1  2  3  4  | 12 13 | 0   0

Every linear layer runs once over all N tokens (one pass over the weights a step, whatever the
mix); only attention tells the rows apart. On a GPU it is three launches (kernels/attention.py):
`store_kv` writes every token's key and value (and a padding token's output row: zeros),
`decode_attention` runs the first `decode_rows` tokens (flash-decoding, seq -1 for rows that are
not decode rows), `chunk_attention` the prompt chunks' query tiles. The reference
(`attend_reference`, CPU and the tests' oracle) writes the same cache and runs each segment
through SDPA with BLOOM's ALiBi bias and a causal mask. What is not here: building a batch from
a step (runner.py), the blocks' owners (blocks.py, scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    tables: torch.Tensor  # (rows, blocks_per_row) int64
    max_seq: int
    # An int8 cache's scales, per layer (blocks, heads_per_rank, block_size) fp32: a key or
    # value is its int8 row x the scale of its token and head. None: the cache is in the
    # model's dtype.
    k_scale: list[torch.Tensor] | None = None
    v_scale: list[torch.Tensor] | None = None

    @classmethod
    def allocate(cls, shape, tp_size: int, *, slots: int, max_seq: int, dtype, device,
                 block_size: int | None = None, num_blocks: int | None = None,
                 quantized: bool = False) -> KVCache:  # fmt: skip
        """`slots` rows of up to `max_seq` positions over `num_blocks` blocks of `block_size`
        tokens. By default every row owns its blocks: row r on [r * per_row, (r + 1) * per_row)
        (the engine rewrites the tables as it hands blocks out); the default block size is
        max_seq: one contiguous block per row. `quantized`: int8 keys and values with a
        scale per token and head."""
        block_size = block_size or max_seq
        per_row = -(-max_seq // block_size)
        num_blocks = num_blocks or slots * per_row
        heads = shape.n_head // tp_size
        dims = (num_blocks, heads, block_size, shape.head_dim)
        kv_dtype = torch.int8 if quantized else dtype
        k = [torch.zeros(dims, dtype=kv_dtype, device=device) for _ in range(shape.n_layer)]
        v = [torch.zeros(dims, dtype=kv_dtype, device=device) for _ in range(shape.n_layer)]
        tables = torch.arange(slots * per_row, device=device).view(slots, per_row) % num_blocks
        if not quantized:
            return cls(k, v, tables, max_seq)
        n = shape.n_layer
        ks = [torch.zeros(dims[:3], dtype=torch.float32, device=device) for _ in range(n)]
        vs = [torch.zeros(dims[:3], dtype=torch.float32, device=device) for _ in range(n)]
        return cls(k, v, tables, max_seq, ks, vs)

    def layer(self, i: int) -> tuple:
        """Layer i's (k, v, scales): scales (k_scale, v_scale) of an int8 cache, else None."""
        scales = (self.k_scale[i], self.v_scale[i]) if self.k_scale is not None else None
        return self.k[i], self.v[i], scales

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def bytes_per_block(self) -> int:
        """Device bytes one block takes over all layers (keys, values and an int8 cache's
        scales)."""
        per = [t[0].numel() * t.element_size() for t in (self.k[0], self.v[0])]
        if self.k_scale is not None:
            per += [t[0].numel() * t.element_size() for t in (self.k_scale[0], self.v_scale[0])]
        return sum(per) * len(self.k)

    def apply_updates(self, updates: tuple[int, ...]) -> None:
        """(row, index, block) triples into the block tables, in stream order."""
        t = torch.tensor(updates, dtype=torch.long).view(-1, 3)
        if self.tables.is_cuda:  # through pinned memory: no wait for the step in flight
            t = t.pin_memory().to(self.tables.device, non_blocking=True)
        self.tables[t[:, 0], t[:, 1]] = t[:, 2]

    @property
    def slots(self) -> int:
        return self.tables.shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @staticmethod
    def bytes_per_token(shape, tp_size: int, dtype: torch.dtype, quantized: bool = False) -> int:
        """Keys and values of one token on one rank, every layer (int8: + a scale per head)."""
        if quantized:
            return 2 * shape.n_layer * (shape.hidden_size + 4 * shape.n_head) // tp_size
        return 2 * shape.n_layer * (shape.hidden_size // tp_size) * dtype.itemsize


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., head_dim) -> int8 (..., head_dim) and fp32 scales (...): each row over its largest
    magnitude / 127, rounded half up (as the kernels do)."""
    x = x.float()
    scale = (x.abs().amax(-1) / 127).clamp(min=1e-8)
    q = torch.floor(x / scale[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
    return q, scale


def write_kv(cache: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
             positions: torch.Tensor, values: torch.Tensor, scales=None) -> None:  # fmt: skip
    """cache[row, position] = value for index tensors of one shape S; values (*S, heads, hd);
    `scales` (blocks, heads, block_size): an int8 cache's, written beside."""
    bs = cache.shape[2]
    blocks = tables[rows, positions // bs]
    if scales is not None:
        values, s = quantize_kv(values)
        scales[blocks, :, positions % bs] = s  # (*S, heads)
    # Advanced indices around a slice: the indexed view is (*S, heads, head_dim).
    cache[blocks, :, positions % bs] = values


def read_kv(cache: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, length: int,
            scales=None, dtype=None):  # fmt: skip
    """Positions [0, length) of each row: (B, heads, length, head_dim) (an int8 cache's
    dequantized to `dtype`)."""
    bs = cache.shape[2]
    blocks = tables[rows, : -(-length // bs)]  # (B, nb)
    kv = cache[blocks]  # (B, nb, heads, bs, head_dim)
    if scales is not None:
        kv = (kv.float() * scales[blocks][..., None]).to(dtype)
    B, nb, heads, _, hd = kv.shape
    return kv.transpose(1, 2).reshape(B, heads, nb * bs, hd)[:, :, :length]


def alibi_bias(slopes: torch.Tensor, positions: torch.Tensor, valid_from: torch.Tensor,
               kv_len: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """ALiBi + mask, (B, heads, T, L): slope * (key position - valid_from) where the key is in
    [valid_from, the query's position], the dtype's lowest value elsewhere."""
    key_pos = torch.arange(kv_len, device=positions.device)  # (L,)
    valid = (key_pos >= valid_from[:, None, None]) & (key_pos <= positions[:, :, None])
    distance = (key_pos[None, :] - valid_from[:, None]).to(dtype)  # (B, L)
    bias = slopes.to(dtype)[None, :, None, None] * distance[:, None, None, :]
    bias = bias.expand(-1, -1, positions.shape[1], -1)
    return bias.masked_fill(~valid[:, None], torch.finfo(dtype).min)


@dataclass
class FlatBatch:
    """One step's tokens (see the module's docstring). Device tensors, read by captured graphs
    from fixed addresses: seq, pos (N,); dec_seq, dec_pos (decode_rows,); tiles (4, n_tiles)
    (cache row, first token, count, first position of each prompt-chunk tile). `segments` (cache
    row, first token, count, first position) of every decode row and chunk is the host's copy,
    for the reference path; None in a captured graph."""

    seq: torch.Tensor
    pos: torch.Tensor
    dec_seq: torch.Tensor
    dec_pos: torch.Tensor
    tiles: torch.Tensor
    segments: list[tuple[int, int, int, int]] | None = None

    @property
    def decode_rows(self) -> int:
        return self.dec_seq.shape[0]

    @cached_property
    def dec_from(self) -> torch.Tensor:
        """Where every decode row's attention starts: position 0 (one tensor a step, which
        every layer's decode attention reads)."""
        return torch.zeros_like(self.dec_pos)


def attend_kernels(qkv, kv, tables, batch: FlatBatch, slopes, heads, head_dim):
    """(N, heads * head_dim): the GPU path, three launches over fixed grids; kv is a layer's
    (k_cache, v_cache, scales) (KVCache.layer)."""
    from .kernels.attention import chunk_attention, decode_attention, store_kv

    k_cache, v_cache, scales = kv
    # every token's output row is written by one launch: a padding token's (zeros) by store_kv,
    # a decode row's by decode_attention, a prompt token's by chunk_attention
    out = torch.empty((qkv.shape[0], heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    store_kv(qkv, k_cache, v_cache, batch.seq, batch.pos, tables, scales, out)
    if batch.decode_rows:
        decode_attention(qkv[: batch.decode_rows], k_cache, v_cache, batch.dec_seq, batch.dec_pos,
                         batch.dec_from, slopes, tables, out=out[: batch.decode_rows],
                         scales=scales)  # fmt: skip
    chunk_attention(qkv, k_cache, v_cache, batch.tiles, slopes, tables, out, scales)
    return out


def attend_reference(qkv, kv, tables, batch: FlatBatch, slopes, heads, head_dim):
    """(N, heads * head_dim): each segment through SDPA over the cache, in pure torch (an int8
    cache's keys and values quantized on write and dequantized on read)."""
    k_cache, v_cache, scales = kv
    ks, vs = scales if scales is not None else (None, None)
    N = qkv.shape[0]
    qkv = qkv.view(N, heads, 3, head_dim)
    q, k, v = qkv.unbind(dim=2)  # each (N, heads, head_dim)
    out = torch.zeros((N, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    for row, tok0, n, pos0 in batch.segments:
        rows = torch.full((n,), row, device=qkv.device)
        positions = torch.arange(pos0, pos0 + n, device=qkv.device)
        write_kv(k_cache, tables, rows, positions, k[tok0 : tok0 + n], ks)
        write_kv(v_cache, tables, rows, positions, v[tok0 : tok0 + n], vs)
        keys = read_kv(k_cache, tables, rows[:1], pos0 + n, ks, qkv.dtype)  # (1, heads, L, hd)
        values = read_kv(v_cache, tables, rows[:1], pos0 + n, vs, qkv.dtype)
        bias = alibi_bias(slopes, positions[None], torch.zeros(1, dtype=torch.long,
                          device=qkv.device), pos0 + n, qkv.dtype)  # fmt: skip
        o = F.scaled_dot_product_attention(
            q[tok0 : tok0 + n].transpose(0, 1)[None], keys, values, attn_mask=bias
        )  # (1, heads, n, head_dim)
        out[tok0 : tok0 + n] = o[0].transpose(0, 1)
    return out.view(N, heads * head_dim)
