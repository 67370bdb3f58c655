"""Blocks in host memory (model/offload.py, model/memory.py's plan_offload, the loader's
placement): on a CPU the copies are host to host, with the GPU path's schedule and bookkeeping,
so these tests run the same code. Greedy answers with most blocks offloaded equal those without,
at tp 1 (in this process, every load path) and tp 2 (the real launcher); the planner picks as
few blocks as the budget needs and refuses what cannot work, with the numbers, before loading."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpinfer.config import load_config
from mpinfer.model.memory import GIB, check_fits, plan_memory, plan_offload, spread
from mpinfer.tools.randmodel import SHAPES

from .conftest import ENV, ROOT

LAYERS = 6


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny model with enough blocks for the ring to wrap (6 layers), HF and sharded."""
    from mpinfer.cli import main as mpinfer_main
    from mpinfer.tools.tiny import make_tiny

    root = tmp_path_factory.mktemp("offload")
    hf = make_tiny(root / "hf", layers=LAYERS, hidden=64, heads=4, vocab=1001, shards=2, seed=3)
    assert mpinfer_main(["shard", "--model", str(hf), "--tp", "1", "--out",
                         str(root / "sharded"), "--quant", "int8"]) == 0  # fmt: skip
    return {"hf": hf, "sharded": root / "sharded"}


def generate(model, *settings, nproc: int = 1):
    args = [sys.executable, "-m", "mpinfer.cli", "generate", "--model", str(model), "--quant",
            "int8", "--greedy", "--max-new-tokens", "12", "--json", "--prompt", "the river",
            "--prompt", "a king and a queen of the old city"]  # fmt: skip
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    for s in settings:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc


def test_the_engine_with_blocks_in_host_memory_equals_it_without(deep):
    """In this process at tp 1: 5 of 6 blocks offloaded with 2 in flight (the ring wraps every
    step), from an HF checkpoint and from a sharded one; the same greedy tokens, and every
    offloaded block copied in once per forward."""
    from mpinfer.checkpoint.loader import load_model
    from mpinfer.dist import init_distributed, teardown
    from mpinfer.engine.engine import Engine
    from mpinfer.engine.runner import ModelRunner
    from mpinfer.engine.sampling import SamplingParams
    from mpinfer.startup.runtime import load_tokenizer

    ctx = init_distributed(timeout_s=60, device="cpu")
    try:
        tok = load_tokenizer(str(deep["hf"]))
        prompts = [tok.encode(p, add_special_tokens=False).ids
                   for p in ("the river", "a king and a queen", "of")]  # fmt: skip
        out = {}
        for name, path, blocks in (("plain", deep["hf"], 0), ("hf", deep["hf"], 5),
                                   ("sharded", deep["sharded"], 5)):  # fmt: skip
            cfg = load_config(
                None,
                [
                    f'model.path="{path}"',
                    'quant.method="int8"',
                    f"model.offload_blocks={blocks}",
                    "model.offload_depth=2",
                ],
            )
            loaded = load_model(cfg, ctx)
            off = loaded.model.offload
            assert (off is None) == (blocks == 0)
            if off is not None:
                assert len(off.order) == 5 and off.depth == 2
                assert off.order == spread(5, LAYERS)
            runner = ModelRunner(loaded, ctx, slots=4, max_seq=64)
            engine = Engine(runner, ctx, tok)
            results = []
            for ids in prompts:
                engine.submit(
                    ids,
                    SamplingParams(max_new_tokens=10),
                    lambda ev, results=results: ev.kind == "done" and results.append(ev.result),
                )
            engine.run(until_idle=True, stop_ranks=False)
            out[name] = sorted(r.token_ids for r in results)
            if off is not None:  # 5 blocks through 2 slots: every block, every forward
                assert off.copies == 5 * engine.steps
        assert out["hf"] == out["plain"] and out["sharded"] == out["plain"]
    finally:
        teardown()


def test_tp2_with_blocks_in_host_memory_equals_it_without(deep):
    """The real launcher, 2 ranks, each holding its own shard of the offloaded blocks."""
    plain, _ = generate(deep["hf"], nproc=2)
    offloaded, proc = generate(deep["hf"], "model.offload_blocks=4", "model.offload_depth=1",
                               nproc=2)  # fmt: skip
    assert [r["text"] for r in offloaded] == [r["text"] for r in plain]
    assert "4 of 6 blocks in host memory" in proc.stderr


def test_the_planner_offloads_as_few_blocks_as_the_budget_needs(monkeypatch):
    import psutil

    # A host with the 42 GiB the offloaded blocks need (this machine has less: refused).
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 512 * GIB})())
    shape = SHAPES["bloom-176b"]
    cfg = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"),
                      ["model.offload_blocks=-1", "parallel.tp_size=1"])  # fmt: skip
    budget = 139 * GIB
    full = plan_memory(shape, cfg, tp_size=1, budget=budget)
    assert not full.fits  # 176B int8 on one GPU
    off = plan_offload(shape, cfg, tp_size=1, budget=budget)
    n = len(off.offloaded)
    assert off.offloaded == tuple(spread(n, 70)) and off.depth == 2
    # One block fewer would not leave room for one max_seq_len sequence beside the ring.
    need = full.one_slot - (n - off.depth) * off.block_bytes
    assert need <= budget < need + off.block_bytes
    plan = check_fits(shape, cfg, tp_size=1, device=_FakeGpu(budget))
    assert plan.offload == off and plan.fits
    # Everything fits: nothing offloaded; offloading off: the old refusal.
    assert plan_offload(shape, cfg, tp_size=8, budget=24 * GIB) is None
    off_cfg = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"), ["parallel.tp_size=1"])
    with pytest.raises(ValueError, match="does not fit: needs"):
        check_fits(shape, off_cfg, tp_size=1, device=_FakeGpu(budget))


def test_budgets_that_cannot_work_are_refused_with_the_numbers(monkeypatch):
    shape = SHAPES["bloom-7b1"]
    cfg = load_config(str(ROOT / "configs/bloom-7b1.toml"), ["model.offload_blocks=-1"])
    # Embeddings, workspace and one 2,048-token sequence alone are over 4 GiB.
    with pytest.raises(ValueError, match=r"even with every block in host memory: needs 4\.\d\d "
                                         r"GiB per GPU .* has 4\.00 GiB"):  # fmt: skip
        plan_offload(shape, cfg, tp_size=1, budget=4 * GIB)
    # A plan the host cannot pin is refused before loading.
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": GIB})())
    with pytest.raises(ValueError, match="not enough host memory to hold the offloaded blocks"):
        check_fits(shape, cfg, tp_size=1, device=_FakeGpu(6 * GIB))
    with pytest.raises(ValueError, match="offload_depth=0 must be >= 1"):
        load_config(None, ["model.offload_depth=0"])
    with pytest.raises(ValueError, match="bitsandbytes layers .* cannot be offloaded"):
        load_config(None, ["model.offload_blocks=2", 'quant.method="llm.int8"'])


class _FakeGpu:
    """A device whose budget the config does not name: check_fits asks it for its memory."""

    type = "cuda"

    def __init__(self, total: int):
        self.total = total


@pytest.fixture(autouse=True)
def _fake_gpu_memory(monkeypatch):
    import torch

    from mpinfer.model import memory

    real = memory.budget_bytes

    def budget(cfg, device):
        return device.total if isinstance(device, _FakeGpu) else real(cfg, device)

    monkeypatch.setattr(memory, "budget_bytes", budget)
    yield torch
