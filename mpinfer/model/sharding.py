"""Tensor-parallel sharding: which BLOOM tensor is split how, and each rank's slice of it.

Pure functions of the model shape and tp_size: no process groups, no files. The loader, the
shard command and the memory planner all read the same `ShardSpec` list, so what a rank receives
at load time, what a sharded file holds and what the planner counts are one thing.

    column  (qkv, dense_h_to_4h, their biases)   rows   [r*out/tp, (r+1)*out/tp)
    row     (dense, dense_4h_to_h)               cols   [r*in/tp,  (r+1)*in/tp)
    vocab   (word_embeddings, tied LM head)      rows   [r*V_pad/tp, ...), zero rows past V
    replicate (LayerNorms, row-layer biases)     the whole tensor on every rank

The fused QKV weight is laid out [n_head, 3, head_dim] along its output dim, so a contiguous
block of rows is a block of whole heads: rank r owns heads [r*h/tp, (r+1)*h/tp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bloom import BloomShape
from .quant import quantize_rows


@dataclass(frozen=True)
class ShardSpec:
    name: str  # HF name without the `transformer.` prefix; also the model's parameter name
    shape: tuple[int, ...]  # the full (unsharded) shape in the checkpoint
    split: str  # "column" | "row" | "vocab" | "replicate"
    quantize: bool  # int8 weight + per-row scale, else the compute dtype

    def rank_range(self, tp_rank: int, tp_size: int) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's slice in the checkpoint tensor; None: all of it."""
        if self.split == "replicate" or tp_size == 1 and self.split != "vocab":
            return None
        if self.split == "vocab":
            per_rank = -(-self.shape[0] // tp_size)
            start = min(tp_rank * per_rank, self.shape[0])
            return 0, start, min(start + per_rank, self.shape[0])
        dim = 0 if self.split == "column" else 1
        per_rank = self.shape[dim] // tp_size
        return dim, tp_rank * per_rank, (tp_rank + 1) * per_rank

    def rank_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.split == "replicate":
            return self.shape
        if self.split == "vocab":
            return (-(-self.shape[0] // tp_size), *self.shape[1:])
        dim = 0 if self.split == "column" else 1
        shape = list(self.shape)
        shape[dim] //= tp_size
        return tuple(shape)


def scale_name(name: str) -> str:
    """`...query_key_value.weight` -> `...query_key_value.weight_scale` (per-row int8 scales)."""
    return name + "_scale"


def shard_specs(
    shape: BloomShape, tp_size: int, *, quantize: bool, quantize_embeddings: bool
) -> list[ShardSpec]:
    """Every tensor the model loads, in load order."""
    h, v = shape.hidden_size, shape.vocab_size
    specs = [
        ShardSpec("word_embeddings.weight", (v, h), "vocab", quantize_embeddings),
        ShardSpec("word_embeddings_layernorm.weight", (h,), "replicate", False),
        ShardSpec("word_embeddings_layernorm.bias", (h,), "replicate", False),
    ]
    for i in range(shape.n_layer):
        p = f"h.{i}."
        specs += [
            ShardSpec(p + "input_layernorm.weight", (h,), "replicate", False),
            ShardSpec(p + "input_layernorm.bias", (h,), "replicate", False),
            ShardSpec(p + "self_attention.query_key_value.weight", (3 * h, h), "column", quantize),
            ShardSpec(p + "self_attention.query_key_value.bias", (3 * h,), "column", False),
            ShardSpec(p + "self_attention.dense.weight", (h, h), "row", quantize),
            ShardSpec(p + "self_attention.dense.bias", (h,), "replicate", False),
            ShardSpec(p + "post_attention_layernorm.weight", (h,), "replicate", False),
            ShardSpec(p + "post_attention_layernorm.bias", (h,), "replicate", False),
            ShardSpec(p + "mlp.dense_h_to_4h.weight", (4 * h, h), "column", quantize),
            ShardSpec(p + "mlp.dense_h_to_4h.bias", (4 * h,), "column", False),
            ShardSpec(p + "mlp.dense_4h_to_h.weight", (h, 4 * h), "row", quantize),
            ShardSpec(p + "mlp.dense_4h_to_h.bias", (h,), "replicate", False),
        ]
    specs += [
        ShardSpec("ln_f.weight", (h,), "replicate", False),
        ShardSpec("ln_f.bias", (h,), "replicate", False),
    ]
    return specs


def rank_entries(
    spec: ShardSpec, tp_size: int, dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of what `shard_tensor` returns for one rank, without computing it."""
    shape = spec.rank_shape(tp_size)
    if spec.quantize:
        return [(spec.name, shape, torch.int8), (scale_name(spec.name), shape[:1], torch.float32)]
    return [(spec.name, shape, dtype)]


def shard_tensor(
    spec: ShardSpec, piece: torch.Tensor, tp_size: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Turn this rank's piece of a checkpoint tensor into what the rank's model holds.

    `piece` is the slice `spec.rank_range` names (or the whole tensor). Vocab slices are padded
    with zero rows to the per-rank size. Quantized tensors become int8 + float32 row scales,
    computed over this rank's piece alone; the rest is cast to `dtype` (None: kept as stored).
    """
    if spec.split == "vocab":
        rows = spec.rank_shape(tp_size)[0]
        if piece.shape[0] < rows:
            pad = piece.new_zeros((rows - piece.shape[0], *piece.shape[1:]))
            piece = torch.cat([piece, pad])
    if spec.quantize:
        q, scale = quantize_rows(piece)
        return {spec.name: q, scale_name(spec.name): scale}
    return {spec.name: (piece.to(dtype) if dtype else piece).contiguous()}


def specs_for(shape: BloomShape, tp_size: int, quant: str, embeddings: str) -> list[ShardSpec]:
    """The specs of a run: `quant.method` and `quant.embeddings` as the config names them."""
    return shard_specs(shape, tp_size, quantize=quant != "none",
                       quantize_embeddings=embeddings == "int8")  # fmt: skip
