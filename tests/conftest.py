"""Shared fixtures: tiny random checkpoints made once per session, and a torchrun helper.

Every model is built here from a config (no hub, no network); multi-process runs are real
torchrun jobs with gloo on 127.0.0.1, each under a hard timeout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mpinfer.dist import torchrun_command
from mpinfer.tools.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
# The shape every multi-process test shares: 4 heads (tp 1, 2, 4), a vocab of 1001 that no tp
# size above 1 divides, so the padded vocab rows are exercised.
TINY = dict(layers=2, hidden=64, heads=4, vocab=1001, seed=7)


def torchrun(nproc: int, args: list[str], *, timeout: float = 180, env: dict | None = None):
    """Run a real torchrun job; returns the CompletedProcess (stdout/stderr as text)."""
    cmd = torchrun_command(nproc, args)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env
    )


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
