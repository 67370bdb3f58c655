"""The user's entry points as real processes: launch/generate.py under torchrun, `mpinfer
generate --nproc`, and every user error ending all ranks non-zero with a message naming it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpinfer.tools.tiny import make_tiny

from .conftest import ROOT, TINY, torchrun

PROMPTS = ["The capital of France is", "café 東京 river"]


def parse_json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_generate_json_matches_transformers(ckpts, hf_model):
    args = [
        "launch/generate.py",
        "--model",
        str(ckpts["st_sharded"]),
        "--quant",
        "none",
        "--dtype",
        "float32",
        "--greedy",
        "--json",
        "--max-new-tokens",
        "12",
    ]
    for p in PROMPTS:
        args += ["--prompt", p]
    proc = torchrun(2, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = parse_json_lines(proc.stdout)
    assert [r["prompt"] for r in records] == PROMPTS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts["st_sharded"])
    for r in records:
        ids = tok(r["prompt"], return_tensors="pt").input_ids
        assert ids[0].tolist() == r["prompt_token_ids"]
        gen = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=3,
        )
        expected = gen[0, ids.shape[1] :].tolist()
        if 2 in expected:
            expected = expected[: expected.index(2) + 1]
        assert r["token_ids"] == expected
        assert r["text"] == tok.decode(expected, skip_special_tokens=True)
        assert r["finish_reason"] == ("eos" if expected[-1] == 2 else "length")
    # Logs: the [rank N] prefix, load time and every rank's peak host RAM.
    assert "[rank 0] INFO loaded in" in proc.stderr and "rank 1: peak" in proc.stderr


def test_mpinfer_generate_nproc_starts_its_own_ranks(ckpts):
    common = [
        "--model",
        str(ckpts["st_sharded"]),
        "--greedy",
        "--json",
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "6",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "mpinfer.cli", "generate", "--nproc", "2", *common],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torchrun(2, ["launch/generate.py", *common])
    assert parse_json_lines(proc.stdout) == parse_json_lines(ref.stdout)
    assert "[rank 1]" in proc.stderr or "[rank 0]" in proc.stderr


def rewrite_single(src, dst, edit):
    """Copy checkpoint `src` to `dst` (a single model.safetensors), with `edit(state)` applied."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def bad_models(ckpts, tmp_path_factory):
    base = tmp_path_factory.mktemp("bad")
    single = make_tiny(base / "good_single", **TINY)
    models = {}
    models["heads"] = make_tiny(base / "heads3", layers=1, hidden=48, heads=3, vocab=400)
    models["not_bloom"] = shutil.copytree(single, base / "gpt2")
    cfg = json.loads((models["not_bloom"] / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (models["not_bloom"] / "config.json").write_text(json.dumps(cfg))
    models["missing_file"] = shutil.copytree(ckpts["st_sharded"], base / "missing_file")
    (models["missing_file"] / "model-00002-of-00003.safetensors").unlink()
    models["corrupt_file"] = shutil.copytree(single, base / "corrupt")
    (models["corrupt_file"] / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    models["missing_tensor"] = rewrite_single(
        single,
        base / "missing_tensor",
        lambda s: s.pop("transformer.h.1.mlp.dense_4h_to_h.weight"),
    )
    models["wrong_shape"] = rewrite_single(
        single,
        base / "wrong_shape",
        lambda s: s.update({"transformer.h.0.self_attention.dense.weight": torch.zeros(64, 32)}),
    )
    models["good"] = single
    return models


ERROR_CASES = {
    "heads": ([], "n_head=3 is not divisible by tp_size=2"),
    "good": (["--set", "parallel.tp_size=4"], "parallel.tp_size=4 does not match the world size 2"),
    "not_bloom": ([], "model_type='gpt2'"),
    "missing_file": ([], "model-00002-of-00003.safetensors"),
    "corrupt_file": ([], "model.safetensors cannot be read"),
    "missing_tensor": ([], "tensor h.1.mlp.dense_4h_to_h.weight is missing"),
    "wrong_shape": ([], "h.0.self_attention.dense.weight has shape (64, 32)"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_user_errors_end_every_rank_with_a_clear_message(bad_models, case):
    extra, message = ERROR_CASES[case]
    proc = torchrun(
        2, ["launch/generate.py", "--model", str(bad_models[case]), *extra], timeout=120
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"[rank {rank}] ERROR")]
        assert any(message in ln for ln in lines), (rank, proc.stderr[-3000:])


def test_missing_model_dir_is_an_error(tmp_path):
    proc = torchrun(2, ["launch/generate.py", "--model", str(tmp_path / "nope")], timeout=120)
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr


def test_tp_decode_bench_runs_across_real_ranks(tmp_path):
    # The multi-GPU decode benchmark, on CPU ranks with gloo: it must run and report coherently.
    out = tmp_path / "tp.json"
    proc = torchrun(
        2,
        [
            "-m",
            "mpinfer.tools.tpbench",
            "--shape",
            "tiny",
            "--batches",
            "1",
            "2",
            "--context",
            "16",
            "--out",
            str(out),
        ],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["tp"] == 2 and set(r["decode_ms"]) == {"1", "2"}
    assert all(ms > 0 for ms in r["decode_ms"].values()) and r["all_reduce_ms"] > 0
    assert r["all_reduce_share_b1"] > 0


def mpinfer_cmd(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "mpinfer.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=ROOT)  # fmt: skip


PRE_SPAWN = {
    "tp": (["generate", "--nproc", "3"], "n_head=4 is not divisible by 3; tensor-parallel "
                                         "sizes that work: 1, 2, 4"),
    "key": (["generate", "--nproc", "2", "--set", "server.prot=1"],
            "unknown config key server.prot: did you mean server.port?"),
    "section": (["serve", "--nproc", "2", "--set", "genration.x=4"],
                "unknown config section [genration]: did you mean generation?"),
    "file": (["generate", "--nproc", "2", "--model", "README.md"], "README.md is a file"),
    "dir": (["generate", "--nproc", "2", "--model", "mpinfer"],
            "mpinfer has no config.json, so it is not a model directory"),
    "nproc0": (["generate", "--nproc", "0"], "--nproc=0 must be >= 1"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PRE_SPAWN))
def test_mistakes_are_said_once_before_any_rank_starts(ckpts, case):
    """Config keys (with the closest name), the model path, the tp size against the heads: one
    line, once, exit 2, no rank started (no [rank N] line, nothing from gloo)."""
    argv, message = PRE_SPAWN[case]
    if "--model" not in argv:
        argv = [*argv, "--model", str(ckpts["st_sharded"])]
    t0 = time.time()
    proc = mpinfer_cmd(*argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr[-2000:]
    assert "[rank" not in proc.stderr and "Traceback" not in proc.stderr
    assert time.time() - t0 < 30


def test_a_port_in_use_is_one_clear_line_before_spawning(ckpts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = mpinfer_cmd("serve", "--nproc", "2", "--model", str(ckpts["st_sharded"]),
                           "--port", str(port))  # fmt: skip
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot serve on 127.0.0.1:{port}")
    assert "[rank" not in proc.stderr and "Traceback" not in proc.stderr


def test_verify_on_a_checkpoint_that_is_not_sharded_says_so(ckpts):
    proc = mpinfer_cmd("verify", str(ckpts["st_sharded"]))
    assert proc.returncode == 2
    assert "has no mpinfer.json: a model directory that is not sharded" in proc.stderr
    assert "Errno" not in proc.stderr


def test_a_hub_model_id_resolves_offline_from_the_hub_cache(ckpts, tmp_path):
    """`--model org/name` goes through huggingface_hub: here offline (HF_HUB_OFFLINE=1) against
    a Hub cache laid out as the Hub client lays it out, filled from the tiny checkpoint; with
    torchrun's spelling --nproc-per-node. A name the cache lacks is one clear error."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--bigscience--tiny-bloom"
    snap = repo / "snapshots" / commit
    shutil.copytree(ckpts["st_sharded"], snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = mpinfer_cmd("generate", "--nproc-per-node", "2", "--model", "bigscience/tiny-bloom",
                       "--prompt", "Hello", "--max-new-tokens", "3", "--json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(proc.stdout.splitlines()[-1])["token_ids"]) == 3
    proc = mpinfer_cmd("generate", "--nproc", "2", "--model", "bigscience/nope", env=env)
    assert proc.returncode == 2
    assert "bigscience/nope: no such directory here, and the Hub model is not in the Hub " \
           "cache" in proc.stderr  # fmt: skip


def test_help_texts_are_written_for_users():
    out = mpinfer_cmd("shard", "--help").stdout
    assert "Quantize an HF checkpoint" in out and "docstring" not in out and "`ranks`" not in out


def test_a_port_in_use_under_torchrun_stops_every_rank_with_one_line(ckpts):
    """Bare torchrun has no pre-spawn check: rank 0 finds the port taken and tells the others,
    so the ranks say it once (no rank traceback, none left waiting); what follows is torchrun's
    own failure report."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = torchrun(2, ["launch/serve.py", "--model", str(ckpts["st_sharded"]),
                            "--port", str(port)], timeout=120)  # fmt: skip
    assert proc.returncode != 0
    said = f"could not serve on 127.0.0.1:{port} (port in use?)"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    ranks = [line for line in proc.stderr.splitlines() if line.startswith(("[rank", "ERROR:"))]
    assert ranks == [f"[rank 0] ERROR {said}"], proc.stderr[-3000:]


def test_a_server_port_is_drawn_below_the_ephemeral_range():
    """The test servers' and benchmarks' HTTP ports come from under the OS's ephemeral range, so
    the rendezvous store and gloo's connections (ports the OS hands out) cannot take one between
    its choice and the server's bind; it is free when returned."""
    from pathlib import Path

    from mpinfer.startup.launcher import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port(below_ephemeral=True)
        assert 20000 <= port < min(low, 32768)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
