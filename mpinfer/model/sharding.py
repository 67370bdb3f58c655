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
from .quant import quantize_int4, quantize_rows


@dataclass(frozen=True)
class ShardSpec:
    name: str  # HF name without the `transformer.` prefix; also the model's parameter name
    shape: tuple[int, ...]  # the full (unsharded) shape in the checkpoint
    split: str  # "column" | "row" | "vocab" | "replicate"
    # "int8": int8 weight + per-row scale; "int4": packed int4 + per-group scale and offset
    # (quant.py); "": the compute dtype
    quant: str = ""
    group: int = 0  # int4's group size
    symmetric: bool = False  # int4 without offsets of its own (offset = -8 scale)

    @property
    def quantize(self) -> bool:
        return bool(self.quant)

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
    """`...query_key_value.weight` -> `...query_key_value.weight_scale` (int8's per-row
    scales, int4's per-group ones)."""
    return name + "_scale"


def offset_name(name: str) -> str:
    """`...weight` -> `...weight_offset` (int4's per-group offsets)."""
    return name + "_offset"


def shard_specs(shape: BloomShape, tp_size: int, *, weights: str = "int8",
                embeddings: str = "none", group_size: int = 128,
                symmetric: bool = False) -> list[ShardSpec]:  # fmt: skip
    """Every tensor the model loads, in load order. `weights`: the block matrices' format
    ("int8", "int4" or "none"); `embeddings`: the embedding's ("int8"; "none" or "auto": the
    compute dtype)."""
    h, v = shape.hidden_size, shape.vocab_size
    w = "" if weights == "none" else weights
    e = "int8" if embeddings == "int8" else ""
    group = group_size if w == "int4" else 0

    def mat(name, dims, split):
        return ShardSpec(name, dims, split, w, group, symmetric and w == "int4")

    specs = [
        ShardSpec("word_embeddings.weight", (v, h), "vocab", e),
        ShardSpec("word_embeddings_layernorm.weight", (h,), "replicate"),
        ShardSpec("word_embeddings_layernorm.bias", (h,), "replicate"),
    ]
    for i in range(shape.n_layer):
        p = f"h.{i}."
        specs += [
            ShardSpec(p + "input_layernorm.weight", (h,), "replicate"),
            ShardSpec(p + "input_layernorm.bias", (h,), "replicate"),
            mat(p + "self_attention.query_key_value.weight", (3 * h, h), "column"),
            ShardSpec(p + "self_attention.query_key_value.bias", (3 * h,), "column"),
            mat(p + "self_attention.dense.weight", (h, h), "row"),
            ShardSpec(p + "self_attention.dense.bias", (h,), "replicate"),
            ShardSpec(p + "post_attention_layernorm.weight", (h,), "replicate"),
            ShardSpec(p + "post_attention_layernorm.bias", (h,), "replicate"),
            mat(p + "mlp.dense_h_to_4h.weight", (4 * h, h), "column"),
            ShardSpec(p + "mlp.dense_h_to_4h.bias", (4 * h,), "column"),
            mat(p + "mlp.dense_4h_to_h.weight", (h, 4 * h), "row"),
            ShardSpec(p + "mlp.dense_4h_to_h.bias", (h,), "replicate"),
        ]
    specs += [
        ShardSpec("ln_f.weight", (h,), "replicate"),
        ShardSpec("ln_f.bias", (h,), "replicate"),
    ]
    if group:
        for spec in specs[3:15]:
            in_per_rank = spec.rank_shape(tp_size)[-1]
            if spec.quant and in_per_rank % group:
                raise ValueError(
                    f"quant.group_size={group} does not divide the {in_per_rank} input features "
                    f"per rank of {spec.name.removeprefix('h.0.')} (tp_size={tp_size}); use a "
                    "group size that divides it"
                )
    return specs


def rank_entries(
    spec: ShardSpec, tp_size: int, dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of what `shard_tensor` returns for one rank, without computing it."""
    shape = spec.rank_shape(tp_size)
    if spec.quant == "int4":
        groups = (shape[1] // spec.group, shape[0])  # group-major (quant.py)
        return [(spec.name, (shape[0], shape[1] // 2), torch.uint8),
                (scale_name(spec.name), groups, torch.float16),
                (offset_name(spec.name), groups, torch.float16)]  # fmt: skip
    if spec.quant:
        return [(spec.name, shape, torch.int8), (scale_name(spec.name), shape[:1], torch.float32)]
    return [(spec.name, shape, dtype)]


def shard_tensor(
    spec: ShardSpec, piece: torch.Tensor, tp_size: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Turn this rank's piece of a checkpoint tensor into what the rank's model holds.

    `piece` is the slice `spec.rank_range` names (or the whole tensor). Vocab slices are padded
    with zero rows to the per-rank size. Quantized tensors become int8 + float32 row scales, or
    packed int4 + fp16 group scales and offsets, computed over this rank's piece alone; the rest
    is cast to `dtype` (None: kept as stored).
    """
    if spec.split == "vocab":
        rows = spec.rank_shape(tp_size)[0]
        if piece.shape[0] < rows:
            pad = piece.new_zeros((rows - piece.shape[0], *piece.shape[1:]))
            piece = torch.cat([piece, pad])
    if spec.quant == "int4":
        packed, scale, offset = quantize_int4(piece, spec.group, symmetric=spec.symmetric)
        return {spec.name: packed, scale_name(spec.name): scale, offset_name(spec.name): offset}
    if spec.quant:
        q, scale = quantize_rows(piece)
        return {spec.name: q, scale_name(spec.name): scale}
    return {spec.name: (piece.to(dtype) if dtype else piece).contiguous()}


def specs_for(shape: BloomShape, tp_size: int, quant) -> list[ShardSpec]:
    """The specs of a run from its `[quant]` section (config.QuantConfig, or anything with
    its method, embeddings, group_size and symmetric); llm.int8 stores int8 too."""
    weights = {"none": "none", "int4": "int4"}.get(quant.method, "int8")
    return shard_specs(shape, tp_size, weights=weights, embeddings=quant.embeddings,
                       group_size=quant.group_size, symmetric=quant.symmetric)  # fmt: skip
