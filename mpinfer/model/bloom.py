"""BLOOM, tensor-parallel and int8-native, with a KV cache in blocks: the model layer.

What is here: `BloomShape` (the architecture numbers of a config.json), `BloomModel` (attribute
names copy the HF checkpoint, `h.3.self_attention.query_key_value.weight`, so a state dict maps
one to one; built on the meta device, the loader assigns real tensors), and
`LoadedModel` (a model with its place in the tensor-parallel group, what loading hands to the
engine). What is not: loading (loader.py), the split of each tensor across ranks (sharding.py),
the CUDA graphs of the decode step (runner.py), sampling (sampling.py).

Two layouts of a batch, one set of weights and blocks (the cache and the flat batch: attention.py):
- `forward_flat`: the engine's step, every token of every decode row and prompt chunk in one
  dimension (N, hidden): one pass over the weights, whatever the mix.
- `forward`: a padded batch (B, T): row b writes its T new tokens at positions [start_pos[b],
  start_pos[b] + T) of cache row slots[b] and attends to [valid_from[b], start_pos[b] + t];
  positions before valid_from[b] are left padding (tests and tools). On a GPU a one-token step
  runs the fused decode kernel, which skips rows whose slot is -1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..dist import divide
from .attention import (
    FlatBatch,
    KVCache,
    alibi_bias,
    attend_kernels,
    attend_reference,
    read_kv,
    write_kv,
)
from .layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from .offload import Offload
from .quant import DenseMethod, LinearMethod

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list or a CPU tensor) on `device` without waiting for the GPU: a copy from
    pageable memory would first wait for every kernel already queued (the step in flight), so
    it goes through pinned memory, whose caching allocator keeps the block until the copy ran."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype or torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


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
        vocab = cfg.get("vocab_size")
        # Bounds far past any BLOOM (176B: 70 layers, hidden 14336, 112 heads, 250880 tokens),
        # so a config that lies is refused before anything is planned or allocated.
        for key, value, most in (
            ("hidden_size", hidden, 1 << 17),
            ("n_head", n_head, 4096),
            ("n_layer", n_layer, 1024),
            ("vocab_size", vocab, 1 << 23),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= most:
                raise ValueError(f"config.json: {key}={value!r} must be an integer from 1 to "
                                 f"{most}")  # fmt: skip
        if hidden % n_head:
            raise ValueError(
                f"config.json: hidden_size={hidden} is not divisible by n_head={n_head}"
            )

        def token(key: str, default: int) -> int:
            value = cfg.get(key)
            return default if value is None else int(value)

        return cls(
            vocab_size=vocab,
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


def alibi_slopes(n_head: int) -> torch.Tensor:
    """The ALiBi slope of every global head (BLOOM's schedule, including non-power-of-2 counts)."""
    closest = 2 ** math.floor(math.log2(n_head))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base**p for p in range(1, closest + 1)]
    if closest != n_head:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, n_head - closest)
        slopes += [extra_base**p for p in range(1, 1 + 2 * remaining, 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def layer_norm(ln: nn.LayerNorm, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    """`ln(x)`, through the few-rows Triton kernel on the GPU decode path."""
    if use_kernel:
        from .kernels.layernorm import layer_norm_rows

        return layer_norm_rows(x, ln.weight, ln.bias, ln.eps)
    return ln(x)


class BloomAttention(nn.Module):
    def __init__(self, shape: BloomShape, tp: TPGroup, method: LinearMethod, dtype):
        super().__init__()
        h = shape.hidden_size
        self.num_heads_per_rank = divide(shape.n_head, tp.tp_size, "n_head")
        self.head_dim = shape.head_dim
        self.query_key_value = ColumnParallelLinear(h, 3 * h, tp=tp, method=method, dtype=dtype)
        self.dense = RowParallelLinear(h, h, tp=tp, method=method, dtype=dtype)

    def forward(self, x, bias, k_cache, v_cache, tables, slots, positions, kv_len, fused,
                residual):  # fmt: skip
        """The padded batch: x (B, T, hidden), row b in cache row slots[b]."""
        B, T, _ = x.shape
        qkv = self.query_key_value(x)  # (B, T, heads_per_rank * 3 * head_dim)
        if fused is not None:  # one query token per row, on the GPU: one kernel (kernels/)
            from .kernels.attention import decode_attention

            start_pos, valid_from, slopes = fused
            out = decode_attention(qkv[:, 0], k_cache, v_cache, slots, start_pos, valid_from,
                                   slopes, tables)  # fmt: skip
            return self.dense(out[:, None], residual=residual)  # (B, 1, hidden)
        qkv = qkv.view(B, T, self.num_heads_per_rank, 3, self.head_dim)
        q, k, v = qkv.unbind(dim=3)  # each (B, T, heads_per_rank, head_dim)
        rows = slots[:, None].expand(B, T)
        write_kv(k_cache, tables, rows, positions, k)
        write_kv(v_cache, tables, rows, positions, v)
        keys = read_kv(k_cache, tables, slots, kv_len)  # (B, heads_per_rank, L, head_dim)
        values = read_kv(v_cache, tables, slots, kv_len)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=bias)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, heads_per_rank * head_dim)
        return self.dense(out, residual=residual)

    def forward_flat(self, x, kv, tables, batch: FlatBatch, slopes, use_kernels, residual):
        """The flat batch: x (N, hidden), every token of the step (attention.py); kv the
        layer's (k_cache, v_cache, scales)."""
        qkv = self.query_key_value(x)  # (N, heads_per_rank * 3 * head_dim)
        attend = attend_kernels if use_kernels else attend_reference
        out = attend(qkv, kv, tables, batch, slopes, self.num_heads_per_rank,
                     self.head_dim)  # (N, heads_per_rank * head_dim)  # fmt: skip
        return self.dense(out, residual=residual)


class BloomMLP(nn.Module):
    def __init__(self, shape: BloomShape, tp: TPGroup, method: LinearMethod, dtype):
        super().__init__()
        h = shape.hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(h, 4 * h, tp=tp, method=method, dtype=dtype)
        self.dense_4h_to_h = RowParallelLinear(4 * h, h, tp=tp, method=method, dtype=dtype)

    def forward(self, x, residual):
        return self.dense_4h_to_h(self.dense_h_to_4h(x, gelu=True), residual=residual)


class BloomBlock(nn.Module):
    def __init__(self, shape: BloomShape, tp: TPGroup, method: LinearMethod, dtype):
        super().__init__()
        h, eps = shape.hidden_size, shape.layer_norm_epsilon
        self.post_ln_residual = shape.apply_residual_connection_post_layernorm
        self.input_layernorm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.self_attention = BloomAttention(shape, tp, method, dtype)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.mlp = BloomMLP(shape, tp, method, dtype)

    def forward(self, x, attend, use_kernels: bool):
        """`attend(ln, residual)` is the attention of the batch's layout (padded or flat)."""
        ln = layer_norm(self.input_layernorm, x, use_kernels)
        residual = ln if self.post_ln_residual else x
        # The residual adds ride in the output projections' epilogues (layers.py).
        x = attend(ln, residual)
        ln = layer_norm(self.post_attention_layernorm, x, use_kernels)
        residual = ln if self.post_ln_residual else x
        return self.mlp(ln, residual)


class BloomModel(nn.Module):
    def __init__(
        self,
        shape: BloomShape,
        tp: TPGroup,
        *,
        method: LinearMethod,
        embedding_method: LinearMethod | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.shape, self.tp, self.dtype = shape, tp, dtype
        h = shape.hidden_size
        self.word_embeddings = VocabParallelEmbedding(
            shape.vocab_size, h, tp=tp, method=embedding_method or DenseMethod(), dtype=dtype
        )
        self.word_embeddings_layernorm = nn.LayerNorm(h, eps=shape.layer_norm_epsilon, dtype=dtype)
        self.h = nn.ModuleList(BloomBlock(shape, tp, method, dtype) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(h, eps=shape.layer_norm_epsilon, dtype=dtype)
        self.lm_head = ParallelLMHead(self.word_embeddings)
        self.slopes: torch.Tensor | None = None
        # Fused GPU kernels for the decode step where they apply (off: the eager reference).
        self.use_kernels = True
        # Blocks whose weights live in host memory (offload.py; the loader sets it).
        self.offload: Offload | None = None

    def blocks(self):
        """(index, module to run) of every block, in order: an offloaded block runs in its ring
        slot once its weights are in (`offload.py`), and its slot is handed on after it."""
        off = self.offload
        if off is not None:
            off.start_step()
        for i, block in enumerate(self.h):
            if off is not None and i in off:
                yield i, off.block(i)
                off.done(i)
            else:
                yield i, block

    def after_load(self, device: torch.device) -> None:
        """Per-rank constants that are not weights: this rank's ALiBi slopes."""
        heads = self.shape.n_head // self.tp.tp_size
        start = self.tp.tp_rank * heads
        self.slopes = alibi_slopes(self.shape.n_head)[start : start + heads].to(device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        slots: torch.Tensor | slice,
        start_pos: torch.Tensor,
        valid_from: torch.Tensor,
        kv_len: int,
        output: str = "last",
    ) -> torch.Tensor:
        """input_ids (B, T) -> output "last": logits (B, vocab) of the last token; "all":
        logits (B, T, vocab); "hidden": the final hidden states (B, T, hidden), which
        `lm_head` turns into logits (a long prompt's, a few positions at a time)."""
        B, T = input_ids.shape
        assert cache.k_scale is None, "the padded forward reads a cache in the model's dtype"
        if isinstance(slots, slice):
            slots = torch.arange(slots.start or 0, slots.stop, device=input_ids.device)
        positions = start_pos[:, None] + torch.arange(T, device=input_ids.device)  # (B, T)
        fused, bias = None, None
        if T == 1 and input_ids.is_cuda and self.use_kernels:
            fused = (start_pos, valid_from, self.slopes)
        else:
            bias = alibi_bias(self.slopes, positions, valid_from, kv_len, self.dtype)
        use = fused is not None
        x = self.word_embeddings(input_ids)  # (B, T, hidden)
        x = layer_norm(self.word_embeddings_layernorm, x, use)
        for i, block in self.blocks():
            attn = block.self_attention

            def attend(ln, residual, i=i, attn=attn):
                return attn(ln, bias, cache.k[i], cache.v[i], cache.tables, slots, positions,
                            kv_len, fused, residual)  # fmt: skip

            x = block(x, attend, use)
        if output == "last":
            x = x[:, -1]
        x = layer_norm(self.ln_f, x, use)
        return x if output == "hidden" else self.lm_head(x)

    @torch.inference_mode()
    def forward_flat(self, input_ids: torch.Tensor, cache: KVCache, batch: FlatBatch
                     ) -> torch.Tensor:  # fmt: skip
        """input_ids (N,), one engine step's tokens -> the final hidden states (N, hidden),
        after ln_f; `lm_head` turns the rows that sample into logits."""
        use = input_ids.is_cuda and self.use_kernels
        x = self.word_embeddings(input_ids)  # (N, hidden)
        x = layer_norm(self.word_embeddings_layernorm, x, use)
        for i, block in self.blocks():
            attn = block.self_attention

            def attend(ln, residual, i=i, attn=attn):
                return attn.forward_flat(ln, cache.layer(i), cache.tables, batch, self.slopes,
                                         use, residual)  # fmt: skip

            x = block(x, attend, use)
        return layer_norm(self.ln_f, x, use)


@dataclass
class LoadedModel:
    """A loaded model and what the engine needs to know about it."""

    model: BloomModel
    shape: BloomShape
    tp: TPGroup
    dtype: torch.dtype
    device: torch.device
    model_dir: str
    load_seconds: float = 0.0
    # Every rank's (start, peak, end) anonymous host RSS in MiB during the load; rank 0 only.
    host_rss_mib: list[tuple[float, float, float]] | None = None
    # The config the model was loaded with (config.RunConfig): the given one, or the throughput
    # plan of a model over its budget (offloadplan.py), whose rows and KV dtype start-up uses.
    cfg: object = None
