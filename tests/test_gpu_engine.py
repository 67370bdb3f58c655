"""GPU tests of the engine and the server (run on the GPU machine: pytest -m gpu): the CUDA-graph
decode against the eager one and with programmatic dependent launch, token for token; the
padding rows of a bucket; seeded sampling alone and in a batch; the GPU sampler against the CPU
one; chunked prompts against whole ones; the served process's GPU memory against its budget.
The kernels alone are tests/test_gpu.py's."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine_tokens(runner, prompts, params_list, **engine_kw):
    """Greedy or seeded generations of `prompts` through the engine on `runner` (one GPU)."""
    from mpinfer.engine.engine import Engine

    engine = Engine(runner, runner.ctx, _ByteTok(), **engine_kw)
    results = {}
    for i, (p, params) in enumerate(zip(prompts, params_list)):
        engine.submit(p, params, lambda ev, i=i: ev.kind != "token" and results.update({i: ev}))
    engine.run(until_idle=True)
    assert all(ev.kind == "done" for ev in results.values()), results
    return [results[i].result.token_ids for i in range(len(prompts))]


class _ByteTok:
    """A stand-in tokenizer: the engine only decodes ids to text here."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _uneven_batch(shape, seed: int):
    """(prompts, params, budgets): 8 random prompts of 1-200 tokens with budgets of 7-40
    greedy tokens, so rows leave a batch at different steps."""
    from mpinfer.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    lens, budgets = [3, 17, 64, 5, 200, 33, 1, 90], [40, 25, 33, 12, 40, 7, 40, 19]
    prompts = [torch.randint(4, shape.vocab_size, (n,), generator=g).tolist() for n in lens]
    return prompts, [SamplingParams(max_new_tokens=b) for b in budgets], budgets


def test_graph_decode_equals_eager_decode_token_for_token():
    """The engine on the bloom-7b1 shape (int8, fp16), 8 prompts of different lengths and
    budgets in one batch, so rows leave and the step replays smaller buckets with padding rows:
    the captured graphs give exactly the eager path's greedy tokens."""
    from mpinfer.engine.runner import step_buckets
    from mpinfer.tools.randmodel import build_random, make_runner

    model, shape, tp = build_random("bloom-7b1", "int8")
    prompts, params, budgets = _uneven_batch(shape, 0)
    out = {}
    for graphs in (True, False):
        runner = make_runner(model, shape, tp, slots=8, max_seq=256, cuda_graphs=graphs)
        assert runner.use_graphs == graphs
        assert not graphs or sorted(runner.graphs) == step_buckets(8, runner.max_prefill_tokens)
        out[graphs] = _engine_tokens(runner, prompts, params)
        del runner
    assert [len(t) for t in out[True]] == budgets
    assert out[True] == out[False]


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch_of_32():
    """A seeded request's tokens do not depend on what else runs: alone, and beside 31 other
    requests (greedy and sampling, other seeds), on the GPU. fp32 weights and activations, so
    the model's logits for a row do not move with the batch size (the int8 fp16 kernels pick
    per-batch configurations whose last bits differ; the sampler itself is exact either way:
    test_sampling.py)."""
    from mpinfer.engine.sampling import SamplingParams
    from mpinfer.tools.randmodel import build_random, make_runner

    model, shape, tp = build_random("bloom-560m", "none", dtype=torch.float32)
    runner = make_runner(model, shape, tp, slots=32, max_seq=128)
    g = torch.Generator().manual_seed(1)
    target = SamplingParams(max_new_tokens=24, do_sample=True, temperature=0.8, top_k=40,
                            top_p=0.9, repetition_penalty=1.1, seed=4321)  # fmt: skip
    prompt = torch.randint(4, shape.vocab_size, (20,), generator=g).tolist()
    alone = _engine_tokens(runner, [prompt], [target])[0]
    others = [torch.randint(4, shape.vocab_size, (int(n),), generator=g).tolist()
              for n in torch.randint(1, 60, (31,), generator=g)]  # fmt: skip
    other_params = [SamplingParams(max_new_tokens=30, do_sample=i % 3 != 0, seed=i,
                                   temperature=0.7 + i / 20) for i in range(31)]  # fmt: skip
    batch = _engine_tokens(runner, others[:13] + [prompt] + others[13:],
                           other_params[:13] + [target] + other_params[13:])  # fmt: skip
    assert batch[13] == alone
    assert alone != _engine_tokens(runner, [prompt], [SamplingParams(max_new_tokens=24)])[0]


def test_sampler_on_the_gpu_is_batch_independent_and_matches_the_cpu():
    from mpinfer.engine.sampling import Row, Sampler, SamplingParams

    V = 250880
    g = torch.Generator().manual_seed(2)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    gpu = Sampler(slots=32, vocab_size=V, eos_token_id=2, device=torch.device("cuda"))
    cpu = Sampler(slots=32, vocab_size=V, eos_token_id=2, device=torch.device("cpu"))
    for index in range(10):
        logits = torch.randn(32, V, generator=g) * 3
        rows = [Row(i, params if i == 5 else SamplingParams(seed=i, do_sample=i % 2 == 0), index)
                for i in range(32)]  # fmt: skip
        _, batch, _ = gpu.sample(logits.cuda(), rows)
        _, alone, _ = gpu.sample(logits[5:6].cuda(), [Row(5, params, index)])
        _, on_cpu, _ = cpu.sample(logits, rows)
        assert int(batch[5]) == int(alone[0])
        assert batch.cpu().tolist() == on_cpu.tolist()


def test_padding_rows_of_a_bucket_write_nothing():
    """A step of 3 rows replays the 4-row graph: the padding row (slot -1) writes no cache
    entry, so every slot but the 3 decoded ones is unchanged, bit for bit."""
    from mpinfer.engine.step import Step
    from mpinfer.tools.randmodel import build_random, fill_context, make_runner

    model, shape, tp = build_random("bloom-560m", "int8")
    runner = make_runner(model, shape, tp, slots=6, max_seq=64)
    fill_context(runner, 6, 20)
    before = [t.clone() for t in runner.cache.k + runner.cache.v]
    runner.execute(Step(decode_slots=(4, 0, 2), decode_pos=(20, 20, 20)))
    tables, bs = runner.cache.tables, runner.cache.block_size
    untouched = tables[[1, 3, 5]].flatten()  # every block of the rows that did not decode
    written = tables[[0, 2, 4], 20 // bs]  # the block holding position 20 of each decoded row
    for old, new in zip(before, runner.cache.k + runner.cache.v):
        assert torch.equal(old[untouched], new[untouched])
        assert not torch.equal(old[written], new[written])


def test_chunked_prompts_equal_unchunked_through_the_engine():
    """Prompts longer than the step's token budget are prefilled in chunks across steps, beside
    other rows decoding; greedy tokens equal a budget that takes each prompt whole (fp32, so
    only summation order differs), with graphs."""
    from mpinfer.engine.sampling import SamplingParams
    from mpinfer.tools.randmodel import build_random, make_runner

    model, shape, tp = build_random("bloom-560m", "int8", dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    lens = [300, 5, 129, 64, 700, 1]
    prompts = [torch.randint(4, shape.vocab_size, (n,), generator=g).tolist() for n in lens]
    params = [SamplingParams(max_new_tokens=12) for _ in lens]
    out = {}
    for budget in (48, 1024):
        runner = make_runner(model, shape, tp, slots=4, max_seq=768, max_prefill_tokens=budget)
        out[budget] = _engine_tokens(runner, prompts, params, max_prefill_tokens=budget)
        del runner
    assert out[48] == out[1024]


@pytest.fixture(scope="module")
def random_560m(tmp_path_factory):
    """bloom-560m's shape with random weights on disk (1 GB, fp16): a real model's layout."""
    from mpinfer.tools.randmodel import SHAPES
    from mpinfer.tools.tiny import make_tiny

    s = SHAPES["bloom-560m"]
    path = tmp_path_factory.mktemp("m560") / "bloom-560m-random"
    make_tiny(path, layers=s.n_layer, hidden=s.hidden_size, heads=s.n_head, vocab=s.vocab_size,
              shards=2, dtype="float16", device="cuda")  # fmt: skip
    torch.cuda.empty_cache()
    return path


@pytest.mark.parametrize("budget, offload", [("4GiB", False), ("under-resident", True)])
def test_the_server_never_holds_more_than_its_budget(random_560m, budget, offload):
    """`mpinfer serve` under a budget, 64 closed-loop clients of the unique mix (prompts of 20
    to 1,400 tokens, 32-256 new tokens) for 15 s, the server's GPU memory as NVML counts it read
    every 100 ms: the peak is at most the budget. "under-resident" is 64 MiB under what the
    planner counts for bloom-560m resident at 64 slots with int8 embeddings and one max_seq_len
    sequence (about 2.9 GiB, a third of it the sampler's pass over 64 rows of a 250,880-token
    vocabulary), so that neither int8 embeddings (quant.embeddings="auto" picks them when they
    fit a budget) nor anything else keeps every block on the GPU: blocks in host memory,
    planned for throughput."""
    import asyncio

    import httpx

    from mpinfer.config import load_config, parse_bytes
    from mpinfer.model.memory import plan_memory
    from mpinfer.tools import loadgen
    from mpinfer.tools.budgetbench import ProcessMemory
    from mpinfer.tools.randmodel import SHAPES
    from mpinfer.tools.serverproc import ServerProcess

    sets = ('quant.method="int8"', 'model.dtype="float16"', "server.max_batch_slots=64")
    if budget == "under-resident":
        cfg = load_config(None, (*sets, 'quant.embeddings="int8"'))
        resident = plan_memory(SHAPES["bloom-560m"], cfg, tp_size=1, budget=0)
        budget = f"{resident.one_slot // 2**20 - 64}MiB"
    server = ServerProcess(
        1, str(random_560m), *sets, f'model.memory_budget="{budget}"', "server.max_queue=1024"
    )
    mem = ProcessMemory(server.proc.pid)
    try:
        info = httpx.get(server.url + "/info", timeout=10).json()
        load = asyncio.run(loadgen.closed_loop(server.url, 64, 15))
    finally:
        peak = mem.close()["peak_MiB"]
        server.stop()
        log = server.output()
    assert load["errors"] == 0 and load["requests"] > 64, load
    limit = parse_bytes(budget, "budget") / 2**20
    assert peak is not None and peak <= limit, (peak, limit, info)
    assert ("blocks in host memory" in log) == offload, (budget, log[-3000:])
