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
from mpinfer.model.memory import GIB, plan_memory
from mpinfer.model.offloadplan import check_fits, offloaded_one_slot, plan_offload, spread
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


def generate(model, *settings, nproc: int = 1, gpu_mem: str = ""):
    args = [sys.executable, "-m", "mpinfer.cli", "generate", "--model", str(model), "--quant",
            "int8", "--greedy", "--max-new-tokens", "12", "--json", "--prompt", "the river",
            "--prompt", "a king and a queen of the old city"]  # fmt: skip
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    if gpu_mem:
        args += ["--gpu-mem", gpu_mem]
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
            if off is not None:  # 5 blocks through 2 slots: every block, every forward, and
                # the first 2 again after the last (fetched ahead for a next step)
                assert off.copies == 5 * engine.steps + 2
                assert off.arena is not None and off.arena.used > 0 and not off.arena.pinned
        assert out["hf"] == out["plain"] and out["sharded"] == out["plain"]
    finally:
        teardown()


def test_tp2_with_blocks_in_host_memory_equals_it_without(deep):
    """The real launcher, 2 ranks, each holding its own shard of the offloaded blocks, as many
    as `--gpu-mem` leaves no room for (the default model.offload_blocks = -1)."""
    from mpinfer.model.bloom import BloomShape
    from mpinfer.model.offloadplan import block_bytes

    shape = BloomShape.from_config(json.loads((deep["hf"] / "config.json").read_text()))
    cfg = load_config(None, ['quant.method="int8"', "model.offload_depth=1"])
    need = offloaded_one_slot(shape, cfg, tp_size=2)
    budget = need - 3 * block_bytes(shape, cfg, 2) + 1  # 3 blocks over, and the ring
    plain, _ = generate(deep["hf"], nproc=2)
    offloaded, proc = generate(deep["hf"], "model.offload_depth=1", nproc=2,
                               gpu_mem=str(budget))  # fmt: skip
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
    need = offloaded_one_slot(shape, cfg, tp_size=1) - (n - off.depth) * off.block_bytes
    assert need <= budget < need + off.block_bytes
    plan = check_fits(shape, cfg, tp_size=1, device=_FakeGpu(budget))
    assert plan.offload == off and plan.fits
    # Everything fits: nothing offloaded; offloading off: the old refusal.
    assert plan_offload(shape, cfg, tp_size=8, budget=24 * GIB) is None
    off_cfg = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"),
                          ["parallel.tp_size=1", "model.offload_blocks=0"])  # fmt: skip
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

    from mpinfer.model import memory, offloadplan

    real = memory.budget_bytes

    def budget(cfg, device):
        return device.total if isinstance(device, _FakeGpu) else real(cfg, device)

    monkeypatch.setattr(memory, "budget_bytes", budget)
    monkeypatch.setattr(offloadplan, "budget_bytes", budget)
    yield torch


def test_the_offload_benchmark_checks_its_logits_on_a_cpu(monkeypatch):
    """`mpinfer bench gpu --gpu-mem` on a CPU: the planner's blocks go to the host arena, and
    the logits with offload equal the synchronous reference and the same weights all resident
    (the checks the GPU run reports for BLOOM-176B and bloom-7b1)."""
    import argparse
    import dataclasses

    from mpinfer.model.offloadplan import block_bytes
    from mpinfer.tools import offloadbench, randmodel

    shape = dataclasses.replace(SHAPES["tiny"], n_layer=LAYERS)
    monkeypatch.setitem(randmodel.SHAPES, "tiny6", shape)
    cfg = offloadbench.bench_config(8, False)
    blk = block_bytes(shape, cfg, 1)
    # Two blocks too many (2 + a ring of 2 offloaded) beside one row of 8 + 16 tokens of KV.
    kv = 24 * offloadbench.kv_token_bytes(shape, False)
    budget = offloaded_one_slot(shape, cfg, tp_size=1) - 2 * blk + kv
    a = argparse.Namespace(shape="tiny6", gpu_mem=str(budget), batches="1,4", context=8,
                           kv_cache_dtype="auto", kv_rows=1, no_baseline=True)  # fmt: skip
    r = offloadbench.run_offload(a)
    assert r["plan"]["offloaded"] == spread(4, LAYERS) and r["plan"]["depth"] == 2
    assert r["vs_sync_reference"]["max_abs"] == 0 and r["vs_all_resident"]["max_abs"] == 0
    assert r["vs_all_resident"]["max_logit"] > 0
    assert set(r["offload_ms"]) == {1, 4} and set(r["depth_ms"]) == {1, 2, 3}
    assert "4 of 6 blocks in host memory" in offloadbench.markdown(r)


def test_a_failed_copy_fails_every_request_of_the_step_not_a_wrong_answer(deep):
    """A copy into the ring that fails mid-step (injected in the third step): the engine fails
    (the server's fault handling: every rank stops), every request ends with that error, and
    none ends with tokens computed on a block whose weights never arrived."""
    from mpinfer.checkpoint.loader import load_model
    from mpinfer.dist import init_distributed, teardown
    from mpinfer.engine.engine import Engine
    from mpinfer.engine.runner import ModelRunner
    from mpinfer.engine.sampling import SamplingParams

    ctx = init_distributed(timeout_s=60, device="cpu")
    try:
        cfg = load_config(None, [f'model.path="{deep["hf"]}"', 'quant.method="int8"',
                                 "model.offload_blocks=5"])  # fmt: skip
        loaded = load_model(cfg, ctx)
        off = loaded.model.offload
        fetch, calls = off._fetch, {"n": 0}

        def failing(b):
            calls["n"] += 1
            if calls["n"] == 13:  # the third step's
                raise RuntimeError("host-to-device copy failed")
            fetch(b)

        off._fetch = failing
        engine = Engine(ModelRunner(loaded, ctx, slots=4, max_seq=64), ctx, None)
        events = []
        for ids in ([5, 6, 7], [8, 9]):
            engine.submit(ids, SamplingParams(max_new_tokens=10), events.append)
        with pytest.raises(RuntimeError, match="host-to-device copy failed"):
            engine.run(until_idle=True, stop_ranks=False)
        ends = [e for e in events if e.kind in ("done", "error")]
        assert [e.kind for e in ends] == ["error", "error"]
        assert all("host-to-device copy failed" in e.error for e in ends)
    finally:
        teardown()


def test_plan_refuses_a_host_without_the_ram_to_pin_the_blocks(capsys):
    from mpinfer.cli import main as mpinfer_main

    args = ["plan", "--config", str(ROOT / "configs/bloom-176b-8x24gb.toml"), "--tp", "1",
            "--gpu-mem", "139GiB"]  # fmt: skip
    assert mpinfer_main(args + ["--host-mem", "39GiB"]) == 1
    err = capsys.readouterr().err
    # 17 blocks of 2.30 GiB, the least that lets one sequence fit the GPU, and 1 GiB to spare
    assert "not enough host memory to hold the offloaded blocks: needs 40.1 GiB" in err
    assert mpinfer_main(args + ["--host-mem", "43GiB"]) == 0
    out = capsys.readouterr().out
    assert "blocks in host memory             17 of 70" in out and "step at batch 32" in out
    # the throughput plan keeps the config's 16 rows (a KV cache of 16 x 256 is all they use)
    assert "throughput plan                   17 blocks in host memory, 16 rows" in out
