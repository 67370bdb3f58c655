"""The memory planner against hand-computed numbers for the published BLOOM configs, `mpinfer
plan`'s answers, and the start-up refusal when the budget is too small."""

from __future__ import annotations

import json

import pytest

from mpinfer.cli import main as mpinfer_main
from mpinfer.config import load_config
from mpinfer.model.bloom import BloomShape
from mpinfer.model.memory import plan_memory

from .conftest import ROOT, torchrun


def shape_of(name: str) -> BloomShape:
    return BloomShape.from_config(json.loads((ROOT / f"configs/arch/{name}.json").read_text()))


def test_bloom_176b_tp8_int8_per_rank():
    cfg = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"))
    plan = plan_memory(shape_of("bloom-176b"), cfg, tp_size=8, budget=24 * 2**30)
    h = 14336
    # Per block: qkv 3h*h + dense h*h + h_to_4h 4h*h + 4h_to_h h*4h = 12 h^2, an eighth per rank.
    assert plan.items["weights (int8)"] == 70 * 12 * h * h // 8 == 21_579_694_080
    # One fp32 scale per output row of each rank's slice: qkv 3h/8, dense h, h4h 4h/8, 4hh h.
    assert plan.items["scales"] == 70 * 4 * (3 * h // 8 + h + 4 * h // 8 + h) + 31360 * 4
    assert plan.items["embeddings and LM head"] == 250880 // 8 * h  # int8 rows of the vocab
    assert plan.kv_bytes_per_token == 2 * 70 * (h // 8) * 2 == 501_760  # K and V, fp16
    assert plan.fits and plan.kv_tokens >= 2048  # the headline: 8 x 24 GB, >= 2048 tokens


def test_bloom_7b1_fp16_and_int8():
    cfg = load_config(str(ROOT / "configs/bloom-7b1.toml"), ['quant.method="none"'])
    fp16 = plan_memory(shape_of("bloom-7b1"), cfg, tp_size=1, budget=80 * 2**30)
    assert fp16.items["weights (float16)"] == 30 * 12 * 4096**2 * 2 == 12_079_595_520
    assert fp16.items["embeddings and LM head"] == 250880 * 4096 * 2
    int8 = plan_memory(shape_of("bloom-7b1"), load_config(str(ROOT / "configs/bloom-7b1.toml")),
                       tp_size=1, budget=80 * 2**30)  # fmt: skip
    assert int8.items["weights (int8)"] * 2 == fp16.items["weights (float16)"]
    assert int8.kv_bytes_per_token == 2 * 30 * 4096 * 2


def test_plan_command_prints_gib_lines_and_fails_when_too_small(capsys):
    assert mpinfer_main(["plan", "--config", str(ROOT / "configs/bloom-176b-8x24gb.toml")]) == 0
    out = capsys.readouterr().out
    assert "weights (int8)                 20.10 GiB" in out
    code = mpinfer_main(["plan", "--config", str(ROOT / "configs/bloom-176b-8x24gb.toml"),
                         "--tp", "4", "--set", "model.offload_blocks=0"])  # fmt: skip
    out = capsys.readouterr().out
    # 42.62 GiB of weights, workspace and margin + one 2048-token sequence of 0.957 MiB a token.
    assert code == 1 and "does not fit: needs 44.53 GiB per GPU, has 23.99; try tp=8" in out
    # By default the planner puts blocks in host memory instead, and says what would not.
    code = mpinfer_main(["plan", "--config", str(ROOT / "configs/bloom-176b-8x24gb.toml"),
                         "--tp", "4", "--host-mem", "512GiB"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "blocks in host memory             38 of 70" in out
    assert "every block on the GPU would need 44.53 GiB per GPU, has 23.99: try tp=8" in out
    code = mpinfer_main(["plan", "--config", str(ROOT / "configs/bloom-7b1.toml"),
                         "--gpu-mem", "12GiB", "--quant", "none",
                         "--set", "model.offload_blocks=0"])  # fmt: skip
    assert code == 1 and "try tp=2" in capsys.readouterr().out


def test_workspace_counts_the_sampler_and_the_step_graphs():
    cfg = load_config(str(ROOT / "configs/bloom-7b1.toml"), ["server.max_batch_slots=48"])
    plan = plan_memory(shape_of("bloom-7b1"), cfg, tp_size=1, budget=80 * 2**30)
    v, h = 250880, 4096
    assert plan.items["sampler state"] == 48 * v * 5  # a bool and an int32 per slot and token
    # The shared logits (a row per slot) and hidden states (the largest bucket's tokens: the
    # step cap, 512, where slots + the prompt budget would be 560), fp16; the pool: one decode
    # step's activations.
    assert plan.items["step graphs"] == (48 * v + 512 * h) * 2 + 48 * 16 * h * 4
    uncapped = load_config(str(ROOT / "configs/bloom-7b1.toml"),
                           ["server.max_batch_slots=48", "server.max_step_tokens=0"])  # fmt: skip
    most = 48 + cfg.server.max_prefill_tokens
    assert plan_memory(shape_of("bloom-7b1"), uncapped, tp_size=1, budget=80 * 2**30).items[
        "step graphs"] == (48 * v + most * h) * 2 + 48 * 16 * h * 4  # fmt: skip
    off = load_config(str(ROOT / "configs/bloom-7b1.toml"), ["server.cuda_graphs=false"])
    assert "step graphs" not in plan_memory(shape_of("bloom-7b1"), off, tp_size=1,
                                            budget=80 * 2**30).items  # fmt: skip


def test_sampler_rows_bound_the_sampler_pass_the_plan_counts():
    """server.sampler_rows caps the rows of one sampler pass, and the plan counts that pass (64
    bytes a logit) and gives the rest to the KV cache; 0 is automatic, a negative value an
    error naming the key."""
    v = 250880
    auto = load_config(str(ROOT / "configs/bloom-7b1.toml"), ["server.max_batch_slots=48"])
    four = load_config(str(ROOT / "configs/bloom-7b1.toml"),
                       ["server.max_batch_slots=48", "server.sampler_rows=4"])  # fmt: skip
    p_auto, p_four = (plan_memory(shape_of("bloom-7b1"), c, tp_size=1, budget=24 * 2**30)
                      for c in (auto, four))  # fmt: skip
    assert p_auto.items["sampler temporaries"] == 48 * v * 64  # 48 rows fit one pass of 66
    assert p_four.items["sampler temporaries"] == max(4 * v * 64, 16 * v * (2 + 12))
    assert p_four.kv_tokens > p_auto.kv_tokens
    with pytest.raises(ValueError, match="server.sampler_rows=-1"):
        load_config(str(ROOT / "configs/bloom-7b1.toml"), ["server.sampler_rows=-1"])


def test_the_plan_counts_sequences_in_blocks_not_in_max_seq_len_slots():
    """BLOOM-176B int8 on 8 x 24 GB cards (24,564 MiB, everything the process holds counted):
    the static layout's one slot of 2,048 tokens becomes 5 requests of 512 + 256 in blocks of
    16 (10 with an int8 cache), int4 weights 31 (60); bloom-7b1 int8 on a 24 GiB card: 15 slots
    become >= 40."""
    cfg = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"))
    card = 24564 * 2**20
    plan = plan_memory(shape_of("bloom-176b"), cfg, tp_size=8, budget=card)
    assert plan.slots == 1 and plan.kv_blocks == plan.kv_tokens // 16
    assert plan.sequences(768) == min(plan.kv_blocks // 48, 16) == 5
    kv8 = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"),
                      ['server.kv_cache_dtype="int8"'])  # fmt: skip
    assert plan_memory(shape_of("bloom-176b"), kv8, tp_size=8, budget=card).sequences(768) == 10
    int4 = load_config(str(ROOT / "configs/bloom-176b-8x24gb-int4.toml"))
    plan4 = plan_memory(shape_of("bloom-176b"), int4, tp_size=8, budget=card)
    assert plan4.fixed + plan4.kv_blocks * 16 * plan4.kv_bytes_per_token <= card
    assert plan4.sequences(768) == 31 >= 24
    int4_kv8 = load_config(str(ROOT / "configs/bloom-176b-8x24gb-int4.toml"),
                           ['server.kv_cache_dtype="int8"'])  # fmt: skip
    assert plan_memory(shape_of("bloom-176b"), int4_kv8, tp_size=8,
                       budget=card).sequences(768) == 60 >= 48  # fmt: skip
    assert plan.sequences(770) == plan.kv_blocks // 49  # a started block is a whole block
    cfg = load_config(str(ROOT / "configs/bloom-7b1.toml"),
                      ['quant.method="int8"', "server.max_batch_slots=64"])  # fmt: skip
    plan = plan_memory(shape_of("bloom-7b1"), cfg, tp_size=1, budget=24 * 2**30)
    assert plan.slots == 15 and plan.sequences(768) >= 40
    static = load_config(str(ROOT / "configs/bloom-7b1.toml"),
                         ['quant.method="int8"', "server.kv_block_size=2048",
                          "server.max_batch_slots=64"])  # fmt: skip
    assert plan_memory(shape_of("bloom-7b1"), static, tp_size=1,
                       budget=24 * 2**30).sequences(768) == 15  # fmt: skip


@pytest.mark.parametrize("config", ["tiny-cpu", "bloom-560m", "bloom-7b1", "bloom-176b-8x24gb"])
def test_plan_answers_for_every_shipped_config_without_a_gpu_size(config, capsys):
    """No --gpu-mem: a table over common GPU sizes and the tp sizes that divide the heads (a
    config that names its budget and tp, as the 176B one does, gets that GPU's details)."""
    code = mpinfer_main(["plan", "--config", str(ROOT / f"configs/{config}.toml")])
    out = capsys.readouterr().out
    assert code == 0, out
    if config == "bloom-176b-8x24gb":
        assert "tp=8" in out and "sequences of max_seq_len=2048       1" in out
        assert "sequences of 512+256               5" in out and "= 24,564 MiB" in out
        code = mpinfer_main(["plan", "--config", str(ROOT / f"configs/{config}.toml"),
                             "--set", 'model.memory_budget=""'])  # fmt: skip
        out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()
            if line.strip().split(" ")[0] in ("16GiB", "24GiB", "140GiB")]  # fmt: skip
    assert rows and all(r[2] in ("yes", "no") for r in rows), out
    if config == "bloom-176b-8x24gb":  # tp 8 is this config's: 24 GiB fits, 16 does not
        assert rows[0][:3] == ["16GiB", "8", "no"] and rows[1][:3] == ["24GiB", "8", "yes"]
    else:
        assert {r[1] for r in rows} >= {"1", "2", "4"} and rows[-1][2] == "yes"


@pytest.mark.parametrize("budget", ["300KiB"])
def test_start_up_refuses_before_loading_when_memory_is_short(ckpts, budget):
    proc = torchrun(2, ["launch/generate.py", "--model", str(ckpts["st_sharded"]),
                        "--set", f'model.memory_budget="{budget}"'], timeout=120)  # fmt: skip
    assert proc.returncode != 0
    for rank in (0, 1):
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"[rank {rank}] ERROR")]
        assert any("does not fit even with every block in host memory: needs" in ln
                   and "has 0.00 GiB" in ln for ln in errors)  # fmt: skip
    assert "loaded in" not in proc.stderr


def test_plan_into_a_closed_pipe_ends_quietly():
    """`mpinfer plan | head -1`: the reader has gone; no traceback, the status a shell gives a
    writer ended by SIGPIPE."""
    import os
    import subprocess
    import sys

    from .conftest import ENV

    read, write = os.pipe()
    os.close(read)  # every write to the pipe fails, as after head has its line
    code = "import sys; from mpinfer.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "plan", "--arch",
                           str(ROOT / "configs/arch/bloom-176b.json")], cwd=ROOT, env=ENV,
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_the_kv_pool_is_what_the_process_does_not_hold_under_the_budget():
    """fit_blocks: the pool replaces the provisional one (its bytes are in `used`), everything
    stays under the budget and under what the GPU has free, with the margin to spare."""
    from mpinfer.model.memory import fit_blocks

    mib = 2**20
    block = 7 * mib + 123  # not a divisor of anything below
    kw = dict(margin=256 * mib, block_bytes=block, current=40)
    blocks = fit_blocks(used=20_000 * mib, free=100_000 * mib, budget=24_576 * mib, **kw)
    total = 20_000 * mib - 40 * block + blocks * block
    assert total <= 24_576 * mib - 256 * mib < total + block
    # the GPU has less free than the budget allows (another process on it): free decides
    tight = fit_blocks(used=20_000 * mib, free=2_000 * mib, budget=24_576 * mib, **kw)
    assert (tight - 40) * block <= 2_000 * mib - 256 * mib < (tight - 39) * block
    assert fit_blocks(used=20_000 * mib, free=10**12, budget=10**12, cap=100, **kw) == 100
    assert fit_blocks(used=30_000 * mib, free=10**12, budget=24_576 * mib, **kw) == 0


def test_over_the_budget_the_plan_is_for_throughput_not_resident_blocks():
    """bloom-7b1 int8 at 6 GiB: every block in host memory (a step costs its copies at any
    batch, so a resident block's memory is worth more as KV room), int8 KV, rows raised to
    what the cache holds; a config that sets its rows keeps them; a model that fits, and a
    config that names its offload_blocks, are left alone; the host's RAM bounds the blocks."""
    from mpinfer.model.offloadplan import PLANNED_SEQUENCE, plan_for_throughput, plan_offload

    gib = 2**30
    shape = shape_of("bloom-7b1")
    cfg = load_config(None, ['model.memory_budget="6GiB"'])
    kw = dict(tp_size=1, budget=6 * gib, host_bytes=100 * gib, host_gbps=55.0, gpu_tbps=4.3,
              gpu_tflops=788.0)  # fmt: skip
    least = len(plan_offload(shape, cfg, tp_size=1, budget=6 * gib).offloaded)
    planned, fast = plan_for_throughput(shape, cfg, **kw)
    assert least < 30 and fast.blocks == planned.model.offload_blocks == 30
    assert planned.server.kv_cache_dtype == "int8"
    assert planned.server.max_batch_slots == fast.rows <= fast.kv_tokens // PLANNED_SEQUENCE
    assert fast.rows > 32 and abs(fast.tok_s - fast.rows / fast.step_ms * 1e3) < 1e-6
    # The plan's KV room is that of the config it returns (its rows' sampler pass included),
    # and holds a planned sequence per row: bloom-560m at 3 GiB with 64 rows asked for.
    from mpinfer.model.offloadplan import with_offload

    small = shape_of("bloom-560m")
    for shp, c, budget in ((shape, cfg, 6 * gib), (small, load_config(None, [
            'quant.method="int8"', "server.max_batch_slots=64", 'quant.embeddings="none"']),
            3 * gib)):  # fmt: skip
        got, plan = plan_for_throughput(shp, c, **{**kw, "budget": budget})
        again = with_offload(plan_memory(shp, got, tp_size=1, budget=budget),
                             plan_offload(shp, got, tp_size=1, budget=budget))  # fmt: skip
        assert again.kv_tokens == plan.kv_tokens >= plan.rows * PLANNED_SEQUENCE, (plan, again)
    mine = load_config(None, ['model.memory_budget="6GiB"', "server.max_batch_slots=8",
                              'server.kv_cache_dtype="model"'])  # fmt: skip
    kept, _ = plan_for_throughput(shape, mine, **kw)
    assert kept.server.max_batch_slots == 8 and kept.server.kv_cache_dtype == "model"
    few, fast = plan_for_throughput(shape, cfg, **{**kw, "host_bytes": 6 * gib})
    assert least <= fast.blocks < 30  # what 6 GiB of host RAM can pin (5 GiB of 192 MiB blocks)
    for unchanged in (
        load_config(None, ['model.memory_budget="24GiB"']),
        load_config(None, ['model.memory_budget="6GiB"', "model.offload_blocks=28"]),
    ):
        assert plan_for_throughput(shape, unchanged, **{**kw, "budget": parse(unchanged)}) == (
            unchanged, None)  # fmt: skip


def test_auto_embeddings_are_int8_where_the_offload_plan_gains_by_them():
    """quant.embeddings="auto" (the default) over the budget: bloom-7b1 at 6 GiB gets int8
    embeddings, because its fp16 embedding is 1.9 GiB of the budget and the plan with int8 ones
    predicts more rows and tokens/s than the same plan with "none" (asked for by name, and
    kept); bloom-560m at 3 GiB with 64 slots fits with every block on the GPU once its
    embeddings are int8, so it gets that and no offload; a model that fits keeps "auto" (the
    compute dtype: every consumer reads it as "none")."""
    from mpinfer.model.offloadplan import EMBEDDINGS_GAIN, plan_for_throughput, plan_offload
    from mpinfer.model.sharding import specs_for

    gib = 2**30
    shape = shape_of("bloom-7b1")
    kw = dict(tp_size=1, budget=6 * gib, host_bytes=100 * gib, host_gbps=55.0, gpu_tbps=4.3,
              gpu_tflops=788.0)  # fmt: skip
    auto, fast = plan_for_throughput(shape, load_config(None, []), **kw)
    named, slow = plan_for_throughput(shape, load_config(None, ['quant.embeddings="none"']), **kw)
    assert auto.quant.embeddings == "int8" and fast.embeddings_int8
    assert named.quant.embeddings == "none" and not slow.embeddings_int8
    assert fast.rows > slow.rows and fast.tok_s >= slow.tok_s * EMBEDDINGS_GAIN
    assert fast.kv_tokens > slow.kv_tokens
    small = shape_of("bloom-560m")
    c = load_config(None, ['quant.method="int8"', "server.max_batch_slots=64"])
    got, plan = plan_for_throughput(small, c, **{**kw, "budget": 3 * gib})
    assert plan is None and got.quant.embeddings == "int8"
    assert plan_offload(small, got, tp_size=1, budget=3 * gib) is None
    assert plan_offload(small, c, tp_size=1, budget=3 * gib) is not None
    fits = load_config(None, ['model.memory_budget="24GiB"'])
    assert plan_for_throughput(shape, fits, **{**kw, "budget": 24 * gib}) == (fits, None)
    # "auto" shards and plans as the compute dtype wherever it is not decided
    kinds = {s.name: s.quant for s in specs_for(small, 1, fits.quant)}
    assert kinds["word_embeddings.weight"] == ""


def test_a_small_model_whose_sampler_outweighs_its_blocks_is_planned_not_refused(monkeypatch):
    """bloom-560m with 64 slots: its 24 blocks are 12 MiB each, its sampler's pass over 66 rows
    of a 250,880-token vocabulary about 1 GiB. Offloaded, a model samples 16 rows a pass and
    steps eagerly (no graphs), so the offload plan counts that, not the resident model's
    sampler: just under the resident need it offloads a few blocks (it was refused as "does not
    fit even with every block in host memory"), and where only int8 embeddings fit at all,
    "auto" chooses them instead of refusing with them as a hint. The returned config, planned
    again, fits its budget; start-up's gate (check_fits) agrees."""
    from mpinfer.model.offloadplan import plan_for_throughput, plan_offload, with_offload

    mib = 2**20
    small = shape_of("bloom-560m")
    sets = ['quant.method="int8"', "server.max_batch_slots=64"]
    resident = plan_memory(small, load_config(None, [*sets, 'quant.embeddings="int8"']),
                           tp_size=1, budget=0).one_slot  # fmt: skip
    kw = dict(tp_size=1, host_bytes=100 * 2**30, host_gbps=55.0, gpu_tbps=4.3, gpu_tflops=788.0)
    for budget, embeddings in ((resident - 64 * mib, "none"), (2100 * mib, "auto")):
        cfg = load_config(None, [*sets, f'quant.embeddings="{embeddings}"'])
        if embeddings == "none":
            off = plan_offload(small, cfg, tp_size=1, budget=budget)
            assert off is not None and len(off.offloaded) < small.n_layer
        else:
            with pytest.raises(ValueError, match="every block in host memory"):
                plan_offload(small, cfg, tp_size=1, budget=budget)
        got, fast = plan_for_throughput(small, cfg, budget=budget, **kw)
        assert fast is not None and fast.rows >= 16, fast
        assert got.quant.embeddings == ("int8" if embeddings == "auto" else "none")
        again = with_offload(plan_memory(small, got, tp_size=1, budget=budget),
                             plan_offload(small, got, tp_size=1, budget=budget))  # fmt: skip
        assert again.fits and again.kv_tokens == fast.kv_tokens, (again, fast)
    with pytest.raises(ValueError, match="every block in host memory"):
        plan_for_throughput(small, load_config(None, sets), budget=1500 * mib, **kw)
    # Start-up's gate counts the automatic offload as the offloaded model runs, too.
    from mpinfer.model import offloadplan

    budget = resident - 64 * mib
    cfg = load_config(None, [*sets, 'quant.embeddings="int8"'])
    monkeypatch.setattr(offloadplan, "budget_bytes", lambda *_: budget)
    plan = offloadplan.check_fits(small, cfg, tp_size=1, device=None, host=False)
    assert plan.fits and plan.offload is not None and plan.fixed < budget


def parse(cfg):
    from mpinfer.config import parse_bytes

    return parse_bytes(cfg.model.memory_budget, "budget")


def test_a_simulated_rank_of_the_headline_config_starts_as_serve_starts_it(monkeypatch):
    """tools/diag/startup_memory --simulate-tp (the one-GPU check of a 24 GB card's rank): rank
    0 of a tp-2 model with the 176B 8x24 GB config's quantization (int8 weights and
    embeddings), built in place and started through runtime.start, holds its shard and serves
    (here on the CPU, the tiny shape)."""
    import torch

    from mpinfer.dist import DistContext
    from mpinfer.engine.sampling import SamplingParams
    from mpinfer.startup import runtime
    from mpinfer.tools.diag import startup_memory

    real = startup_memory.build_random
    monkeypatch.setattr(startup_memory, "build_random", lambda *a, **k: real(
        *a, **k, device="cpu", dtype=torch.float32))  # fmt: skip
    cfg = load_config(str(ROOT / "configs/bloom-176b-8x24gb.toml"),
                      ["server.max_seq_len=128", "server.max_batch_slots=2"])  # fmt: skip
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None, None)
    runner = startup_memory.simulated_rank("tiny", 2, cfg, ctx)
    model = runner.loaded.model
    qkv = model.h[0].self_attention.query_key_value.weight
    assert runner.loaded.tp.tp_size == 2 and qkv.dtype == torch.int8
    assert qkv.shape == (3 * 64 // 2, 64)  # tiny: hidden 64, a half of qkv's rows a rank
    assert model.word_embeddings.weight.dtype == torch.int8
    engine = runtime.start(cfg, ctx, runner=runner)
    done = []
    engine.submit(
        [5, 6, 7, 8],
        SamplingParams(max_new_tokens=6, ignore_eos=True),
        lambda ev: done.append(ev) if ev.kind in ("done", "error") else None,
    )
    engine.run(until_idle=True, stop_ranks=False)
    assert [ev.kind for ev in done] == ["done"] and len(done[0].result.token_ids) == 6
