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
`store_kv` writes every token's key and value, `decode_attention` runs the first `decode_rows`
tokens (flash-decoding, seq -1 for rows that are not decode rows), `chunk_attention` the prompt
chunks' query tiles. The reference (`attend_reference`, CPU and the tests' oracle) writes the
same cache and runs each segment through SDPA with BLOOM's ALiBi bias and a causal mask. What is
not here: building a batch from a step (runner.py), the blocks' owners (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    tables: torch.Tensor  # (rows, blocks_per_row) int64
    max_seq: int

    @classmethod
    def allocate(cls, shape, tp_size: int, *, slots: int, max_seq: int, dtype, device,
                 block_size: int | None = None) -> KVCache:  # fmt: skip
        """`slots` rows of `max_seq` positions, row r on blocks [r * per_row, (r + 1) * per_row);
        the default block size is max_seq: one contiguous block per row."""
        block_size = block_size or max_seq
        per_row = -(-max_seq // block_size)
        heads = shape.n_head // tp_size
        dims = (slots * per_row, heads, block_size, shape.head_dim)
        k = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.n_layer)]
        v = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.n_layer)]
        tables = torch.arange(slots * per_row, device=device).view(slots, per_row)
        return cls(k, v, tables, max_seq)

    @property
    def slots(self) -> int:
        return self.tables.shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @staticmethod
    def bytes_per_token(shape, tp_size: int, dtype: torch.dtype) -> int:
        return 2 * shape.n_layer * (shape.hidden_size // tp_size) * dtype.itemsize


def write_kv(cache: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
             positions: torch.Tensor, values: torch.Tensor) -> None:  # fmt: skip
    """cache[row, position] = value for index tensors of one shape S; values (*S, heads, hd)."""
    bs = cache.shape[2]
    blocks = tables[rows, positions // bs]
    # Advanced indices around a slice: the indexed view is (*S, heads, head_dim).
    cache[blocks, :, positions % bs] = values


def read_kv(cache: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, length: int):
    """Positions [0, length) of each row: (B, heads, length, head_dim)."""
    bs = cache.shape[2]
    blocks = tables[rows, : -(-length // bs)]  # (B, nb)
    kv = cache[blocks]  # (B, nb, heads, bs, head_dim)
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


def attend_kernels(qkv, k_cache, v_cache, tables, batch: FlatBatch, slopes, heads, head_dim):
    """(N, heads * head_dim): the GPU path, three launches over fixed grids."""
    from .kernels.attention import chunk_attention, decode_attention, store_kv

    store_kv(qkv, k_cache, v_cache, batch.seq, batch.pos, tables)
    out = torch.zeros((qkv.shape[0], heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if batch.decode_rows:
        zeros = torch.zeros_like(batch.dec_pos)
        decode_attention(qkv[: batch.decode_rows], k_cache, v_cache, batch.dec_seq, batch.dec_pos,
                         zeros, slopes, tables, out=out[: batch.decode_rows])  # fmt: skip
    chunk_attention(qkv, k_cache, v_cache, batch.tiles, slopes, tables, out)
    return out


def attend_reference(qkv, k_cache, v_cache, tables, batch: FlatBatch, slopes, heads, head_dim):
    """(N, heads * head_dim): each segment through SDPA over the cache, in pure torch."""
    N = qkv.shape[0]
    qkv = qkv.view(N, heads, 3, head_dim)
    q, k, v = qkv.unbind(dim=2)  # each (N, heads, head_dim)
    out = torch.zeros((N, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    for row, tok0, n, pos0 in batch.segments:
        rows = torch.full((n,), row, device=qkv.device)
        positions = torch.arange(pos0, pos0 + n, device=qkv.device)
        write_kv(k_cache, tables, rows, positions, k[tok0 : tok0 + n])
        write_kv(v_cache, tables, rows, positions, v[tok0 : tok0 + n])
        keys = read_kv(k_cache, tables, rows[:1], pos0 + n)  # (1, heads, L, head_dim)
        values = read_kv(v_cache, tables, rows[:1], pos0 + n)
        bias = alibi_bias(slopes, positions[None], torch.zeros(1, dtype=torch.long,
                          device=qkv.device), pos0 + n, qkv.dtype)  # fmt: skip
        o = F.scaled_dot_product_attention(
            q[tok0 : tok0 + n].transpose(0, 1)[None], keys, values, attn_mask=bias
        )  # (1, heads, n, head_dim)
        out[tok0 : tok0 + n] = o[0].transpose(0, 1)
    return out.view(N, heads * head_dim)
