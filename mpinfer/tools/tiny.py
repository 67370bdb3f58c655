"""make-tiny: random BLOOM checkpoints in HF layout, with a tokenizer trained here.

The files are those a real checkpoint has: config.json; model.safetensors or pytorch_model.bin,
or several shards with a `*.index.json`; tokenizer.json + tokenizer_config.json (byte-level BPE
trained with `tokenizers` on a generated corpus), loadable by `AutoTokenizer.from_pretrained`.
Keys carry the `transformer.` prefix, as `save_pretrained` writes them (or not, with
`prefix=False`, as the original bigscience repos have them). Weights are scaled so that logits
are far from uniform: greedy decoding then depends on every weight, and tests mean something.
Shards are generated and written one at a time, so a multi-GB checkpoint needs little RAM
(`device="cuda"` draws them on a GPU: a bloom-7b1-sized checkpoint in seconds). When the trained
tokenizer has fewer tokens than the model's vocabulary, filler tokens (" w123") complete it, so
every id a random model generates decodes to text, as with a real checkpoint.

    mpinfer make-tiny out/tiny [--layers 2 --hidden 64 --heads 4 --vocab 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from ..model.bloom import BloomShape
from ..model.sharding import shard_specs

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, as BLOOM has them
WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be "
    "capital city france paris river king queen model token weight matrix rank group tensor "
    "server request stream answer question prompt number time year people world water light "
    "café naïve résumé 東京 日本語 données größe ñandú"
).split()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "va", "de", "an", "or", "el"]
    vocab = WORDS + [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)
    ]
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(vocab) for _ in range(rng.randint(4, 16))]
        line = " ".join(words).capitalize() + rng.choice([".", ",", "?", "!", ":", ";"])
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 99999)}"
        lines.append(line)
    return lines


def train_tokenizer(out: Path, vocab_size: int, seed: int, *, fill_to: int = 0) -> int:
    """Byte-level BPE with BLOOM's special tokens, then filler tokens up to `fill_to`; returns
    the tokenizer's vocabulary size."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    have = tok.get_vocab_size()
    if fill_to > have:
        tok.add_tokens([AddedToken(f" w{i}", normalized=False) for i in range(have, fill_to)])
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "padding_side": "left",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    special = {k: tok_config[k] for k in ("unk_token", "bos_token", "eos_token", "pad_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tok.get_vocab_size()


def bloom_config(shape: BloomShape, dtype: str) -> dict:
    return {
        "architectures": ["BloomForCausalLM"],
        "model_type": "bloom",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
        "layer_norm_epsilon": shape.layer_norm_epsilon,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "unk_token_id": 0,
        "apply_residual_connection_post_layernorm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "slow_but_exact": False,
        "tie_word_embeddings": True,
        "dtype": dtype,
        # Read by mpinfer at start-up, to say that the text will be meaningless.
        "mpinfer_random_weights": True,
    }


def _random_tensor(name: str, shp: tuple[int, ...], hidden: int, gen: torch.Generator):
    device = gen.device
    if name == "ln_f.weight":
        # With tied embeddings, ln_f(h) . E[v] is largest for v = the current token (its own
        # embedding survives in the residual stream), and a random model just repeats its input.
        # Random-sign ln_f weights cancel that self-similarity: greedy text varies (measured:
        # 11% immediate repeats instead of 99%).
        return torch.randn(shp, generator=gen, device=device)
    if name.endswith("layernorm.weight"):
        return 1.0 + 0.2 * torch.randn(shp, generator=gen, device=device)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shp, generator=gen, device=device)
    if name == "word_embeddings.weight":
        # logits = ln_f(h) @ E^T: with unit-variance h, a row std of 4/sqrt(hidden) gives logits
        # of std ~4: far from uniform (entropy ~3.6 nats over 1001 tokens, uniform is 6.9).
        return (4.0 / hidden**0.5) * torch.randn(shp, generator=gen, device=device)
    return (1.0 / shp[1] ** 0.5) * torch.randn(shp, generator=gen, device=device)


def make_tiny(
    out: str | os.PathLike,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 1024,
    shards: int = 1,
    fmt: str = "safetensors",
    seed: int = 0,
    dtype: str = "float32",
    prefix: bool = True,
    tokenizer_vocab: int | None = None,
    device: str = "cpu",
) -> Path:
    """Write a random BLOOM checkpoint directory; returns its path."""
    if fmt not in ("safetensors", "bin"):
        raise ValueError(f"--format={fmt!r}: expected safetensors or bin")
    if shards < 1:
        raise ValueError(f"--shards={shards} must be >= 1")
    if hidden % heads:
        raise ValueError(f"--hidden={hidden} is not divisible by --heads={heads}")
    if vocab < 300:
        raise ValueError(f"--vocab={vocab} must be >= 300 (256 byte tokens + specials + merges)")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in torch_dtype:
        raise ValueError(f"--dtype={dtype!r}: expected one of {list(torch_dtype)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shape = BloomShape(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads)
    (out / "config.json").write_text(json.dumps(bloom_config(shape, dtype), indent=2) + "\n")
    train_tokenizer(out, min(vocab, tokenizer_vocab or 8192), seed, fill_to=vocab)

    specs = shard_specs(shape, 1, weights="none")
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(torch.Size(p.shape).numel() for p in specs) * torch_dtype[dtype].itemsize
    per_shard = -(-total // shards)
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    weight_map: dict[str, str] = {}
    buffer: dict[str, torch.Tensor] = {}
    filled, written = 0, 0

    def flush() -> None:
        nonlocal buffer, filled, written
        written += 1
        fname = f"{stem}.{ext}" if shards == 1 else f"{stem}-{written:05d}-of-{shards:05d}.{ext}"
        if fmt == "safetensors":
            save_file(buffer, str(out / fname), metadata={"format": "pt"})
        else:
            torch.save(buffer, out / fname)
        weight_map.update({k: fname for k in buffer})
        buffer, filled = {}, 0

    for spec in specs:
        t = _random_tensor(spec.name, spec.shape, hidden, gen).to(torch_dtype[dtype]).cpu()
        buffer[("transformer." if prefix else "") + spec.name] = t.contiguous()
        filled += t.numel() * t.element_size()
        if filled >= per_shard and written < shards - 1:
            flush()
    flush()
    if written != shards:
        raise ValueError(f"--shards={shards} is more than this model's {written} tensor groups")
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer make-tiny", description=make_tiny.__doc__,
                                epilog="example: mpinfer make-tiny out/tiny --layers 2 "
                                "--hidden 64 --heads 4 --vocab 1024")  # fmt: skip
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--format", choices=("safetensors", "bin"), default="safetensors")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the random weights are drawn")
    p.add_argument("--no-prefix", action="store_true", help="keys without 'transformer.'")
    a = p.parse_args(argv)
    try:
        out = make_tiny(a.out, layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab,
                        shards=a.shards, fmt=a.format, seed=a.seed, dtype=a.dtype,
                        prefix=not a.no_prefix, device=a.device)  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
