"""make-tiny writes what a real HF BLOOM checkpoint has, and its logits are far from uniform."""

import json
import math

import torch

from mpinfer.checkpoint.hf import HFCheckpoint
from mpinfer.cli import main as mpinfer_main


def test_make_tiny_layout_loads_in_transformers(tmp_path, capsys):
    out = tmp_path / "m"
    assert mpinfer_main(["make-tiny", str(out), "--shards", "2", "--vocab", "700"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "config.json" in names
    assert "model-00001-of-00002.safetensors" in names and "tokenizer.json" in names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert all(k.startswith("transformer.") for k in index["weight_map"])

    from transformers import AutoTokenizer, BloomForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 3
    ids = tok("the capital of france is", return_tensors="pt").input_ids
    model = BloomForCausalLM.from_pretrained(out, dtype=torch.float32)
    probs = model(ids).logits[0].softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    # Uniform over 700 tokens is ln(700) = 6.55 nats; the random model must be far from it.
    assert entropy.mean() < 0.6 * math.log(700), entropy


def test_bin_and_prefixless_checkpoints_read_the_same_tensors(tmp_path):
    assert mpinfer_main(["make-tiny", str(tmp_path / "a"), "--seed", "3"]) == 0
    assert (
        mpinfer_main(
            [
                "make-tiny",
                str(tmp_path / "b"),
                "--seed",
                "3",
                "--format",
                "bin",
                "--no-prefix",
                "--shards",
                "2",
            ]
        )
        == 0
    )
    a, b = HFCheckpoint(tmp_path / "a"), HFCheckpoint(tmp_path / "b")
    assert sorted(a.names()) == sorted(b.names())
    name = "h.1.mlp.dense_4h_to_h.weight"
    torch.testing.assert_close(a.read(name, 1, 64, 128), b.read(name, 1, 64, 128), rtol=0, atol=0)
    assert a.read(name, 1, 64, 128).shape == (64, 64)
