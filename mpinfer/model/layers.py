"""Tensor-parallel layers (Megatron names). Each owns its slice's shape and exactly one collective;
the matmul belongs to the `LinearMethod` it is given (quant.py), so no layer here knows whether
its weight is int8, bitsandbytes or plain.

    ColumnParallelLinear   y_r = x @ W_r^T + b_r          W split by output rows, no collective
                                                          (the next RowParallelLinear consumes y_r)
    RowParallelLinear      y = all_reduce(x_r @ W_r^T + b_0)  W split by input cols, b on rank 0
    VocabParallelEmbedding e = all_reduce(lookup_r(ids))   rows of the vocab, padded to tp
    ParallelLMHead         logits = all_gather(h @ E_r^T)  tied to the embedding's storage

With tp_size == 1 the collectives are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dist import divide
from .quant import LinearMethod, _empty


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group. With tp_size > 1 and no group, the rank is
    simulated (one rank's shard on one GPU): collectives are skipped and counted."""

    tp_rank: int
    tp_size: int
    group: Any = None  # the compute ProcessGroup; None when tp_size == 1 or simulated
    skipped: dict = field(default_factory=dict, compare=False)  # collective -> count

    @property
    def is_simulated(self) -> bool:
        return self.tp_size > 1 and self.group is None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_simulated:
            self.skipped["all_reduce"] = self.skipped.get("all_reduce", 0) + 1
        elif self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        if self.is_simulated:
            self.skipped["all_gather"] = self.skipped.get("all_gather", 0) + 1
            return x.repeat_interleave(self.tp_size, dim=-1)  # the gathered shape, not values
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, *, tp: TPGroup, method: LinearMethod, dtype):
        super().__init__()
        self.out_features_per_rank = divide(out_features, tp.tp_size, "out_features")
        self.method = method
        method.create_weights(self, self.out_features_per_rank, in_features, dtype)
        self.bias = _empty((self.out_features_per_rank,), dtype)

    def forward(self, x: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
        # (..., out_features_per_rank), through BLOOM's GeLU when asked (fused where possible)
        return self.method.apply_fused(self, x, self.bias, gelu=gelu)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, *, tp: TPGroup, method: LinearMethod, dtype):
        super().__init__()
        self.in_features_per_rank = divide(in_features, tp.tp_size, "in_features")
        self.tp = tp
        self.method = method
        method.create_weights(self, out_features, self.in_features_per_rank, dtype)
        self.bias = _empty((out_features,), dtype)

    def forward(self, x: torch.Tensor, *, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`all_reduce(x_r @ W_r^T) + b (+ residual)`. Rank 0 adds the bias and the residual to
        its share before the sum, so both ride in the matmul's epilogue and the sum needs no
        second pass."""
        first = self.tp.tp_rank == 0
        partial = self.method.apply_fused(
            self, x, self.bias if first else None, residual=residual if first else None
        )  # (..., out_features): this rank's share
        return self.tp.all_reduce(partial)


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank * vocab_per_rank, ...) of the (padded) vocab; ids elsewhere look up zeros."""

    def __init__(self, vocab_size, hidden_size, *, tp: TPGroup, method: LinearMethod, dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // tp.tp_size)
        self.vocab_start = tp.tp_rank * self.vocab_per_rank
        self.tp = tp
        self.method = method
        method.create_weights(self, self.vocab_per_rank, hidden_size, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        rows = self.method.weight_rows(self, local.masked_fill(outside, 0))  # (B, T, hidden)
        rows = rows.masked_fill(outside[..., None], 0)
        return self.tp.all_reduce(rows)


class ParallelLMHead(nn.Module):
    """Logits over the whole vocab from the tied embedding; padded columns are cut off."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        # A plain attribute, not a submodule: the weight is the embedding's, listed once.
        self.__dict__["embedding"] = embedding

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        emb = self.embedding
        local = emb.method.apply(emb, h, None)  # (..., vocab_per_rank)
        logits = emb.tp.all_gather_last_dim(local)  # (..., vocab_per_rank * tp_size)
        return logits[..., : emb.vocab_size]
