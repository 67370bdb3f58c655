"""Two hosts on loopback: two launchers of 2 ranks each make one tp-4 job. torchrun agents with
c10d rendezvous load an HF checkpoint through rank 0 (its slices cross "hosts" over gloo/TCP);
`mpinfer generate --nnodes 2` with static node ranks loads a sharded checkpoint where each host
holds only its own ranks' files. Both give transformers' greedy tokens (the tp-1 engine gives
the same); a host whose directory lacks a rank's file is refused on every rank, naming host,
rank and file; killing one host's launcher ends every rank on both hosts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import torch

from mpinfer.checkpoint.sharded import MANIFEST, rank_file, shard_checkpoint
from mpinfer.startup.launcher import free_port
from mpinfer.tools.serverproc import wait_ready

from .conftest import ENV, ROOT

PROMPTS = ["The capital of France is", "café 東京 river"]
TIMEOUT_S = 20  # parallel.timeout_s of these jobs


def transformers_tokens(hf_model, ckpt, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                do_sample=False, eos_token_id=2, pad_token_id=3)  # fmt: skip
        gen = gen[0, ids.shape[1] :].tolist()
        out.append(gen[: gen.index(2) + 1] if 2 in gen else gen)
    return out


def generate_args(model, n=8) -> list[str]:
    args = ["--model", str(model), "--quant", "none", "--dtype", "float32", "--greedy", "--json",
            "--max-new-tokens", str(n), "--set", f"parallel.timeout_s={TIMEOUT_S}"]  # fmt: skip
    for p in PROMPTS:
        args += ["--prompt", p]
    return args


def run_nodes(commands: list[list[str]], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Start one launcher per "host" at once; wait for all."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd in commands]  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def torchrun_node(port: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
            "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"mpinfer-{port}", "launch/generate.py", *args]  # fmt: skip


def records(results) -> list[dict]:
    lines = [ln for r in results for ln in r.stdout.splitlines() if ln.startswith("{")]
    return [json.loads(ln) for ln in lines]


def test_two_torchrun_agents_load_through_rank_0_and_match_transformers(ckpts, hf_model):
    port = free_port()
    t0 = time.time()
    results = run_nodes([torchrun_node(port, generate_args(ckpts["st_sharded"]))] * 2)
    wall = time.time() - t0
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    got = records(results)  # rank 0 prints, on whichever agent it landed
    assert [g["prompt"] for g in got] == PROMPTS
    expected = transformers_tokens(hf_model, ckpts["st_sharded"], 8)
    assert [g["token_ids"] for g in got] == expected
    logs = "".join(r.stderr for r in results)
    # Every log line of a multi-host job says node and rank; rank 0 reports every rank's RAM.
    assert "[node 0 rank 0] INFO loaded in" in logs or "[node 1 rank 0] INFO loaded in" in logs
    loaded = next(ln for ln in logs.splitlines() if "INFO loaded in" in ln)
    assert all(f"rank {r}: peak" in loaded for r in range(4))
    print(f"\ntwo-node rank-0 load ({wall:.1f} s wall, 4 ranks on 2 cores): {loaded}")


@pytest.fixture(scope="module")
def per_host(ckpts, tmp_path_factory):
    """Each host's directory: the manifest and only its own ranks' files (`shard --ranks`)."""
    base = tmp_path_factory.mktemp("hosts")
    dirs = []
    for node, ranks in enumerate(([0, 1], [2, 3])):
        d = base / f"host{node}"
        manifest = shard_checkpoint(str(ckpts["st_sharded"]), str(d), tp_size=4, quant="none",
                                    ranks=ranks, progress=False)  # fmt: skip
        assert [f["name"] for f in manifest["files"]] == [rank_file(r, 4) for r in ranks]
        assert not (d / rank_file(3 - 2 * node, 4)).exists()
        dirs.append(d)
    return dirs


def mpinfer_node(node: int, port: int, model) -> list[str]:
    return [sys.executable, "-m", "mpinfer.cli", "generate", "--nproc", "2", "--nnodes", "2",
            "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
            *generate_args(model)]  # fmt: skip


def test_each_host_holds_only_its_own_rank_files(per_host, ckpts, hf_model):
    port = free_port()
    results = run_nodes([mpinfer_node(n, port, per_host[n]) for n in (0, 1)])
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert [g["token_ids"] for g in records(results)] == transformers_tokens(
        hf_model, ckpts["st_sharded"], 8)  # fmt: skip


def test_a_host_without_its_rank_file_is_refused_on_every_rank(per_host, tmp_path):
    wrong = shutil.copytree(per_host[1], tmp_path / "wrong")
    (wrong / rank_file(3, 4)).unlink()
    m = json.loads((wrong / MANIFEST).read_text())
    port = free_port()
    results = run_nodes([mpinfer_node(0, port, per_host[0]), mpinfer_node(1, port, wrong)])
    host = socket.gethostname()
    for r in results:
        assert r.returncode != 0
        errors = [ln for ln in r.stderr.splitlines() if "ERROR" in ln]
        # Both ranks of this host name the missing file, the rank and the host.
        assert len({ln.split("]")[0] for ln in errors}) == 2, r.stderr[-2000:]
        assert all(rank_file(3, 4) in ln and f"on host {host}" in ln for ln in errors)
    assert m["ranks"] == [2, 3]


def test_killing_one_hosts_launcher_ends_every_rank_on_both_hosts(ckpts):
    port, http = free_port(), free_port(below_ephemeral=True)
    serve = ["--model", str(ckpts["st_sharded"]), "--quant", "none", "--dtype", "float32",
             "--port", str(http), "--set", f"parallel.timeout_s={TIMEOUT_S}"]  # fmt: skip
    cmd = [sys.executable, "-m", "mpinfer.cli", "serve", "--nproc", "2", "--nnodes", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(n), *serve], cwd=ROOT, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n in (0, 1)]  # fmt: skip
    try:
        assert wait_ready(f"http://127.0.0.1:{http}", nodes[0], 120), "host 0 did not serve"
        r = httpx.post(f"http://127.0.0.1:{http}/generate", timeout=60,
                       json={"inputs": "river", "parameters": {"max_new_tokens": 4}})  # fmt: skip
        assert r.status_code == 200
        ranks = [c for n in nodes for c in psutil.Process(n.pid).children()]
        assert len(ranks) == 4
        t0 = time.time()
        os.kill(nodes[1].pid, signal.SIGKILL)  # host 1's launcher, outright
        deadline = t0 + TIMEOUT_S + 10
        while time.time() < deadline and any(_alive(p) for p in ranks):
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks), [p.pid for p in ranks if _alive(p)]
        assert nodes[0].wait(timeout=30) != 0  # host 0's launcher reports the failure
        print(f"\nevery rank gone {time.time() - t0:.1f} s after host 1's launcher was killed")
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
