"""The tensor-parallel plan: which BLOOM tensor is split how, and each rank's slice of it.

Pure functions of the model shape and tp_size: no process groups, no files. The loader, the
shard command and the memory planner all read the same plan, so what a rank receives at load
time, what a sharded file holds and what the planner counts are one thing.

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

from .quant import quantize_rows


@dataclass(frozen=True)
class BloomShape:
    vocab_size: int
    hidden_size: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @classmethod
    def from_config(cls, cfg: dict) -> BloomShape:
        model_type = cfg.get("model_type")
        if model_type != "bloom":
            raise ValueError(
                f"config.json has model_type={model_type!r}: mpinfer serves BLOOM models only "
                "(model_type 'bloom')"
            )
        # The bigscience repos use n_embed / num_attention_heads; save_pretrained writes the rest.
        hidden = cfg.get("hidden_size", cfg.get("n_embed"))
        n_head = cfg.get("n_head", cfg.get("num_attention_heads"))
        n_layer = cfg.get("n_layer", cfg.get("num_hidden_layers"))
        for key, value in (("hidden_size", hidden), ("n_head", n_head), ("n_layer", n_layer)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {key}={value!r} must be a positive integer")
        if hidden % n_head:
            raise ValueError(
                f"config.json: hidden_size={hidden} is not divisible by n_head={n_head}"
            )

        def token(key: str, default: int) -> int:
            value = cfg.get(key)
            return default if value is None else int(value)

        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            n_layer=n_layer,
            n_head=n_head,
            layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
            apply_residual_connection_post_layernorm=bool(
                cfg.get("apply_residual_connection_post_layernorm", False)
            ),
            bos_token_id=token("bos_token_id", 1),
            eos_token_id=token("eos_token_id", 2),
            pad_token_id=token("pad_token_id", 3),
        )

    def check_tp(self, tp_size: int) -> None:
        if self.n_head % tp_size:
            raise ValueError(f"n_head={self.n_head} is not divisible by tp_size={tp_size}")

    def vocab_per_rank(self, tp_size: int) -> int:
        return -(-self.vocab_size // tp_size)  # ceil: the vocab is padded to a multiple of tp


@dataclass(frozen=True)
class TensorPlan:
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


def plan_model(shape: BloomShape, tp_size: int, *, quantize: bool, quantize_embeddings: bool):
    """Every tensor the model loads, in load order."""
    h, v = shape.hidden_size, shape.vocab_size
    plans = [
        TensorPlan("word_embeddings.weight", (v, h), "vocab", quantize_embeddings),
        TensorPlan("word_embeddings_layernorm.weight", (h,), "replicate", False),
        TensorPlan("word_embeddings_layernorm.bias", (h,), "replicate", False),
    ]
    for i in range(shape.n_layer):
        p = f"h.{i}."
        plans += [
            TensorPlan(p + "input_layernorm.weight", (h,), "replicate", False),
            TensorPlan(p + "input_layernorm.bias", (h,), "replicate", False),
            TensorPlan(p + "self_attention.query_key_value.weight", (3 * h, h), "column", quantize),
            TensorPlan(p + "self_attention.query_key_value.bias", (3 * h,), "column", False),
            TensorPlan(p + "self_attention.dense.weight", (h, h), "row", quantize),
            TensorPlan(p + "self_attention.dense.bias", (h,), "replicate", False),
            TensorPlan(p + "post_attention_layernorm.weight", (h,), "replicate", False),
            TensorPlan(p + "post_attention_layernorm.bias", (h,), "replicate", False),
            TensorPlan(p + "mlp.dense_h_to_4h.weight", (4 * h, h), "column", quantize),
            TensorPlan(p + "mlp.dense_h_to_4h.bias", (4 * h,), "column", False),
            TensorPlan(p + "mlp.dense_4h_to_h.weight", (h, 4 * h), "row", quantize),
            TensorPlan(p + "mlp.dense_4h_to_h.bias", (h,), "replicate", False),
        ]
    plans += [
        TensorPlan("ln_f.weight", (h,), "replicate", False),
        TensorPlan("ln_f.bias", (h,), "replicate", False),
    ]
    return plans


def rank_entries(
    plan: TensorPlan, tp_size: int, dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of what `shard_tensor` returns for one rank, without computing it."""
    shape = plan.rank_shape(tp_size)
    if plan.quantize:
        return [(plan.name, shape, torch.int8), (scale_name(plan.name), shape[:1], torch.float32)]
    return [(plan.name, shape, dtype)]


def shard_tensor(
    plan: TensorPlan, piece: torch.Tensor, tp_size: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Turn this rank's piece of a checkpoint tensor into what the rank's model holds.

    `piece` is the slice `plan.rank_range` names (or the whole tensor). Vocab slices are padded
    with zero rows to the per-rank size. Quantized tensors become int8 + float32 row scales,
    computed over this rank's piece alone; the rest is cast to `dtype` (None: kept as stored).
    """
    if plan.split == "vocab":
        rows = plan.rank_shape(tp_size)[0]
        if piece.shape[0] < rows:
            pad = piece.new_zeros((rows - piece.shape[0], *piece.shape[1:]))
            piece = torch.cat([piece, pad])
    if plan.quantize:
        q, scale = quantize_rows(piece)
        return {plan.name: q, scale_name(plan.name): scale}
    return {plan.name: (piece.to(dtype) if dtype else piece).contiguous()}
