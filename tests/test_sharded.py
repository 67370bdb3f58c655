"""Shard-and-save: the files, interrupt-and-resume, `mpinfer verify`, and load-time errors."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mpinfer.checkpoint.sharded import MANIFEST, rank_file, shard_checkpoint
from mpinfer.tools.tiny import make_tiny

from .conftest import ROOT, torchrun


@pytest.fixture(scope="module")
def sharded2(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("sh") / "tp2"
    shard_checkpoint(str(ckpts["st_sharded"]), str(out), tp_size=2, quant="int8", progress=False)
    return out


def test_sharded_dir_is_a_complete_model_dir(sharded2):
    names = {p.name for p in sharded2.iterdir()}
    assert {MANIFEST, "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {rank_file(0, 2), rank_file(1, 2)} <= names
    assert not any(".tmp-" in n or n.endswith(".partial.json") for n in names)
    manifest = json.loads((sharded2 / MANIFEST).read_text())
    assert manifest["tp_size"] == 2 and manifest["quant"]["method"] == "int8"
    assert manifest["model_config"]["model_type"] == "bloom" and manifest["version"] == 1
    with safe_open(str(sharded2 / rank_file(1, 2)), framework="pt") as f:
        qkv = f.get_tensor("h.0.self_attention.query_key_value.weight")
        assert str(qkv.dtype) == "torch.int8" and tuple(qkv.shape) == (96, 64)
        assert tuple(f.get_tensor("word_embeddings.weight").shape) == (501, 64)  # 1001 padded


def run_shard(src, out, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "mpinfer.cli", "shard", "--model", str(src), "--tp", "4",
         "--out", str(out), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_interrupted_shard_resumes_to_identical_files(tmp_path):
    # Big enough (~190 MB fp32) that each of the 4 rank files takes a noticeable time.
    src = make_tiny(tmp_path / "src", layers=6, hidden=768, heads=12, vocab=4096, seed=1)
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_shard(src, ref).wait(timeout=300) == 0

    proc = run_shard(src, out)
    journal = out / "mpinfer.partial.json"
    deadline = time.time() + 240
    while not journal.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)  # a real signal to the real process, mid-run
    proc.wait(timeout=60)
    assert proc.returncode != 0
    # Nothing looks finished: no manifest; the rank being written is only a temporary file.
    assert not (out / MANIFEST).exists()
    finished = json.loads(journal.read_text())["files"]
    assert 1 <= len(finished) < 4
    assert not (out / rank_file(3, 4)).exists()

    rerun = run_shard(src, out)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    assert f"{rank_file(0, 4)}: finished by an earlier run, checksum matches; kept" in err
    for r in range(4):
        name = rank_file(r, 4)
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert not list(out.glob("*.tmp-*")) and not journal.exists()
    assert (
        subprocess.run(
            [sys.executable, "-m", "mpinfer.cli", "verify", str(out)], capture_output=True
        ).returncode
        == 0
    )


def test_verify_names_an_altered_file(sharded2, tmp_path):
    bad = shutil.copytree(sharded2, tmp_path / "bad")
    data = bytearray((bad / rank_file(1, 2)).read_bytes())
    data[-1] ^= 0xFF
    (bad / rank_file(1, 2)).write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "mpinfer.cli", "verify", str(bad)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1
    assert f"BAD {bad / rank_file(1, 2)}: sha256 does not match" in proc.stdout
    assert f"ok  {rank_file(0, 2)}" in proc.stdout


def test_verify_refuses_a_corrupted_int4_shard(ckpts, tmp_path):
    """int4 shards (packed two weights a byte, groups of 32 along K) pass `verify` as written;
    one flipped bit in a packed weight of rank 1's file fails it, naming that file and no
    other."""
    out = tmp_path / "int4"
    shard_checkpoint(str(ckpts["st_sharded"]), str(out), tp_size=2, quant="int4", group_size=32,
                     progress=False)  # fmt: skip
    with safe_open(str(out / rank_file(1, 2)), framework="pt") as f:
        names = list(f.keys())
        packed = [n for n in names if str(f.get_slice(n).get_dtype()) == "U8"]
        assert packed, names
        assert tuple(f.get_tensor("h.0.self_attention.query_key_value.weight").shape) == (96, 32)
    ok = subprocess.run([sys.executable, "-m", "mpinfer.cli", "verify", str(out)],
                        capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    path = out / rank_file(1, 2)
    data = bytearray(path.read_bytes())
    head = int.from_bytes(data[:8], "little")
    lo, hi = json.loads(data[8 : 8 + head])["h.0.self_attention.query_key_value.weight"][
        "data_offsets"]  # fmt: skip
    data[8 + head + (lo + hi) // 2] ^= 0x10  # one nibble of one packed weight
    path.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "mpinfer.cli", "verify", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1
    assert f"BAD {path}: sha256 does not match" in proc.stdout
    assert f"ok  {rank_file(0, 2)}" in proc.stdout


def test_verify_covers_the_tokenizer_and_config_files(sharded2, tmp_path):
    """A server reads the tokenizer and config.json of a sharded checkpoint as much as its
    weights: an edited tokenizer.json fails `verify`, naming the file."""
    bad = shutil.copytree(sharded2, tmp_path / "bad-tok")
    tok = bad / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"model"', '"model" ', 1))
    proc = subprocess.run([sys.executable, "-m", "mpinfer.cli", "verify", str(bad)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1
    assert f"BAD {tok}: " in proc.stdout
    assert "ok  config.json" in proc.stdout


def altered(src, dst, edit):
    d = shutil.copytree(src, dst)
    edit(d)
    return d


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def set_manifest(d, **changes):
    m = json.loads((d / MANIFEST).read_text())
    m.update(changes)
    (d / MANIFEST).write_text(json.dumps(m))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def lie(d, how: str):
    """Rank 0's file rewritten with one weight of another shape or dtype (the same bytes), and
    the manifest's size and hash made to match: the file is internally consistent, and wrong."""
    from safetensors.torch import load_file, save_file

    from mpinfer.checkpoint.sharded import sha256_file

    path = d / rank_file(0, 2)
    tensors = load_file(str(path))
    name = next(k for k, v in tensors.items() if v.dtype == torch.int8 and v.dim() == 2)
    t = tensors[name]
    tensors[name] = t.t().contiguous() if how == "shape" else t.view(torch.uint8)
    save_file(tensors, str(path), metadata={"format": "mpinfer"})
    m = json.loads((d / MANIFEST).read_text())
    for f in m["files"]:
        if f["name"] == path.name:
            f["bytes"], f["sha256"] = path.stat().st_size, sha256_file(path)
    (d / MANIFEST).write_text(json.dumps(m))


LOAD_ERRORS = {
    # case: (how the directory is broken, extra args, message on every rank)
    "world": (None, 4, [], "was sharded for tp_size=2, but the world size is 4"),
    "missing": (lambda d: (d / rank_file(1, 2)).unlink(), 2, [], "rank file"),
    "truncated": (lambda d: truncate(d / rank_file(0, 2)), 2, [], "(truncated?)"),
    "altered": (lambda d: flip_last_byte(d / rank_file(1, 2)), 2, [], "sha256 does not match"),
    "version": (lambda d: set_manifest(d, version=99), 2, [], "manifest version 99"),
    "quant": (None, 2, ["--quant", "none"], "holds quant.method='int8' weights"),
    "shape": (lambda d: lie(d, "shape"), 2, [], "the plan is"),
    "dtype": (lambda d: lie(d, "dtype"), 2, [], "the plan is"),
}


@pytest.mark.parametrize("case", list(LOAD_ERRORS))
def test_sharded_load_errors_end_every_rank(sharded2, tmp_path, case):
    edit, nproc, extra, message = LOAD_ERRORS[case]
    d = altered(sharded2, tmp_path / case, edit) if edit else sharded2
    proc = torchrun(nproc, ["launch/generate.py", "--model", str(d), *extra], timeout=120)
    assert proc.returncode != 0
    for rank in range(nproc):
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"[rank {rank}] ERROR")]
        assert any(message in ln for ln in lines), (rank, proc.stderr[-3000:])
    if case in ("missing", "truncated", "altered"):
        # The message names the broken file on every rank, not only the rank that owns it.
        broken = rank_file(1 if case != "truncated" else 0, 2)
        assert all(broken in ln for ln in proc.stderr.splitlines() if "ERROR" in ln)


def test_unfinished_shard_dir_is_named(sharded2, tmp_path):
    d = altered(sharded2, tmp_path / "unfinished", lambda d: (d / MANIFEST).unlink())
    proc = torchrun(2, ["launch/generate.py", "--model", str(d)], timeout=120)
    assert proc.returncode != 0 and "an unfinished `mpinfer shard`" in proc.stderr


def test_a_model_directory_that_lies_is_refused_before_anything_is_allocated(ckpts, tmp_path):
    """config.json that is a list, nested 100,000 deep, too large, or with absurd sizes; an
    index pointing outside the directory; a safetensors header of 90 MB; a tokenizer.json that
    is not JSON: each one clear error naming the file, never a traceback or a long load."""
    import struct

    from mpinfer.checkpoint.hf import CheckpointError, HFCheckpoint, read_config
    from mpinfer.model.bloom import BloomShape
    from mpinfer.startup.runtime import load_tokenizer

    def model(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(ckpts["st_sharded"], d)
        return d

    bad = model("list")
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not an object"):
        read_config(bad)
    (bad / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        read_config(bad)
    (bad / "config.json").write_text(" " * (2 << 20))
    with pytest.raises(CheckpointError, match="not a model config"):
        read_config(bad)
    cfg = json.loads((ckpts["st_sharded"] / "config.json").read_text())
    for key, value in (("n_layer", 10**9), ("hidden_size", 2**40), ("vocab_size", 0),
                       ("n_head", True)):  # fmt: skip
        with pytest.raises(ValueError, match=f"{key}=.* must be an integer from 1 to"):
            BloomShape.from_config({**cfg, key: value})
    escape = model("escape")
    index = json.loads((escape / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../outside.safetensors"
    (escape / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file inside"):
        HFCheckpoint(escape)
    header = model("header")
    shard = sorted(header.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 90 << 20) + data[8:])
    with pytest.raises(CheckpointError, match="safetensors header of 94,371,840 bytes"):
        ckpt = HFCheckpoint(header)
        for key in ckpt.files[shard]:
            ckpt.shape(key.removeprefix("transformer."))
    tok = model("tokenizer")
    (tok / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer file"):
        load_tokenizer(str(tok))


def test_sharding_again_after_the_source_changed_rewrites_the_output(ckpts, tmp_path):
    """The same output directory, the source's weights rewritten to the same sizes (other
    values): not "already complete", and the new files hold the new weights."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(ckpts["st_sharded"], src)
    out = tmp_path / "out"
    shard_checkpoint(str(src), str(out), tp_size=2, quant="int8", progress=False)
    before = (out / rank_file(0, 2)).read_bytes()
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        time.sleep(0.01)  # a later modification time, whatever the filesystem's resolution
        save_file({k: (-v if v.is_floating_point() else v) for k, v in tensors.items()}, str(f),
                  metadata={"format": "pt"})  # fmt: skip
    shard_checkpoint(str(src), str(out), tp_size=2, quant="int8", progress=False)
    after = (out / rank_file(0, 2)).read_bytes()
    assert len(after) == len(before) and after != before
    fresh = tmp_path / "fresh"
    shard_checkpoint(str(src), str(fresh), tp_size=2, quant="int8", progress=False)
    assert after == (fresh / rank_file(0, 2)).read_bytes()
