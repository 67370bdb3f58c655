"""Shared fixtures: tiny random checkpoints made once per session, a torchrun helper, real
servers on 127.0.0.1, and the check that the suite leaves no process behind.

Every model is built here from a config (no hub, no network); multi-process runs are real jobs
with gloo on 127.0.0.1, each under a hard timeout. Every process the suite starts carries
MPINFER_TEST_SESSION in its environment; at the end of the session none may be alive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from mpinfer.dist import torchrun_command
from mpinfer.startup.launcher import free_port
from mpinfer.tools.serverproc import wait_ready
from mpinfer.tools.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
# The shape every multi-process test shares: 4 heads (tp 1, 2, 4), a vocab of 1001 that no tp
# size above 1 divides, so the padded vocab rows are exercised.
TINY = dict(layers=2, hidden=64, heads=4, vocab=1001, seed=7)
SESSION = uuid.uuid4().hex
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "MPINFER_TEST_SESSION": SESSION}  # fmt: skip


def torchrun(nproc: int, args: list[str], *, timeout: float = 180, env: dict | None = None):
    """Run a real torchrun job; returns the CompletedProcess (stdout/stderr as text)."""
    return subprocess.run(torchrun_command(nproc, args), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**ENV, **(env or {})})  # fmt: skip


def session_processes() -> list[psutil.Process]:
    """Live processes this test session started (by the marker in their environment)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and p.environ().get("MPINFER_TEST_SESSION") == SESSION:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    yield
    deadline = time.time() + 15  # ranks notice their launcher is gone within a second or two
    while session_processes() and time.time() < deadline:
        time.sleep(0.2)
    left = session_processes()
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, [" ".join(p.cmdline()[:6]) for p in left]


class Server:
    """A real server on 127.0.0.1: `mpinfer serve --nproc N` (or torchrun, `launcher=`),
    quant none, fp32, ready when /health says so."""

    def __init__(self, model, *settings: str, nproc: int = 2, launcher: str = "mpinfer",
                 quant: str = "none", timeout: float = 120):  # fmt: skip
        self.port = free_port(below_ephemeral=True)
        self.headers: dict = {}
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--model", str(model), "--port", str(self.port), "--quant", quant, "--dtype",
                "float32", "--set", "parallel.timeout_s=20",
                *[x for s in settings for x in ("--set", s)]]  # fmt: skip
        if launcher == "torchrun":
            cmd = torchrun_command(nproc, ["launch/serve.py", *args])
        else:
            cmd = [sys.executable, "-m", "mpinfer.cli", "serve", "--nproc", str(nproc), *args]
        self.log = open(ROOT / f".server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        if wait_ready(self.url, self.proc, timeout):
            self.ranks = self.rank_processes()
            return
        out = self.output()
        self.stop()
        raise AssertionError("server did not become ready:\n" + out[-4000:])

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def rank_processes(self) -> list[psutil.Process]:
        ranks = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "RANK" in child.environ():
                    ranks.append(child)
        return sorted(ranks, key=lambda p: int(p.environ()["RANK"]))

    def rank_pid(self, rank: int) -> int:
        return self.ranks[rank].pid

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for whatever is left, ranks included (they are in sessions
        of their own, out of reach of the launcher's process group)."""
        ranks = getattr(self, "ranks", [])
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        for p in ranks:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", headers=self.headers).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(name)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """The same random weights in four layouts (make-tiny's weights depend only on the seed)."""
    base = tmp_path_factory.mktemp("ckpt")
    return {
        "st_sharded": make_tiny(base / "st_sharded", shards=3, **TINY),
        "bin_single_noprefix": make_tiny(base / "bin_single", fmt="bin", prefix=False, **TINY),
        "bin_sharded": make_tiny(base / "bin_sharded", fmt="bin", shards=2, **TINY),
        "st_single_noprefix": make_tiny(base / "st_single", prefix=False, **TINY),
    }


@pytest.fixture(scope="session")
def hf_model(ckpts):
    """transformers' BloomForCausalLM on the same weights, fp32: the oracle."""
    import torch
    from transformers import BloomForCausalLM

    return BloomForCausalLM.from_pretrained(ckpts["st_sharded"], dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def server(ckpts):
    """The suite's main server: 2 ranks, the tiny model, fp32 (exactly transformers' logits)."""
    s = Server(ckpts["st_sharded"], "server.max_seq_len=256", "server.max_queue=64",
               "server.max_stream_backlog=512", "server.max_logprob_entries=98304")  # fmt: skip
    yield s
    s.stop()
