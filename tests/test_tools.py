"""The tools people point at a server, installed from their packages and run unchanged against
mpinfer on the tiny model: lm-evaluation-harness (local-completions against its own hf model on
the same checkpoint), guidellm (its default chat requests and text completions) and LiteLLM
(its openai/ and text-completion-openai/ routes). No network: tasks and data are made here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ENV, ROOT

# The same fp32 weights on both sides, tp 2 against one process: log-likelihoods agree to about
# 1e-5 (reduction order); the bound is 1e-3.
LL_TOL = 1e-3
QUESTIONS = [
    ("the capital of france is", ["paris", "river", "king", "water"], 0),
    ("the king and the", ["queen", "model", "tensor", "city"], 0),
    ("water light people", ["world", "time", "year", "number"], 1),
    ("the river of the", ["city", "king", "stream", "answer"], 2),
    ("a model token weight", ["matrix", "rank", "group", "server"], 0),
    ("café 東京 water", ["river", "paris", "queen", "light"], 3),
]
TASKS = {
    "mp_choice": """task: mp_choice
dataset_path: json
dataset_kwargs:
  data_files: {DATA}/choice.jsonl
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "mp_loglik": """task: mp_loglik
dataset_path: json
dataset_kwargs:
  data_files: {DATA}/loglik.jsonl
test_split: train
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
  - metric: perplexity
""",
}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(d / "choice.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": [" " + c for c in choices],
                                "answer": answer}) + "\n")  # fmt: skip
    with open(d / "loglik.jsonl", "w") as f:
        for q, choices, _ in QUESTIONS:
            f.write(json.dumps({"context": q, "continuation": " " + choices[0]}) + "\n")
    for name, text in TASKS.items():
        (d / f"{name}.yaml").write_text(text.format(DATA=d))
    return d


def run_lm_eval(model: str, model_args: str, tasks_dir, out) -> dict:
    """lm-evaluation-harness's own command line, offline; the logged samples by task."""
    env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
         "--tasks", "mp_choice,mp_loglik", "--include_path", str(tasks_dir),
         "--output_path", str(out), "--log_samples", "--batch_size", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    return {"samples": samples, "results": results, "log": proc.stderr}


def test_lm_evaluation_harness_scores_like_its_own_hf_model(server, ckpts, tasks_dir, tmp_path):
    path = ckpts["st_sharded"]
    # Its defaults: the tokenizer is the server's own (/tokenizer_info, /tokenize, /detokenize).
    ours = run_lm_eval("local-completions", f"base_url={server.url}/v1/completions,model=m,"
                       "num_concurrent=2,max_retries=1", tasks_dir, tmp_path / "ours")  # fmt: skip
    assert "remote tokenizer" in ours["log"].lower()
    ref = run_lm_eval("hf", f"pretrained={path},dtype=float32", tasks_dir,
                      tmp_path / "hf")  # fmt: skip
    for task in ("mp_choice", "mp_loglik"):
        assert ours["results"][task]["acc,none"] == ref["results"][task]["acc,none"]
        a = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
        assert len(a) == len(b) == len(QUESTIONS)
        for x, y in zip(a, b):
            for (ll_x, greedy_x), (ll_y, greedy_y) in zip(
                [r[0] for r in x["resps"]], [r[0] for r in y["resps"]], strict=True
            ):
                assert abs(float(ll_x) - float(ll_y)) < LL_TOL, (task, x["doc_id"])
                assert bool(greedy_x) == bool(greedy_y)


def run_guidellm(server, path, tmp_path, *backend: str) -> dict:
    out = tmp_path / f"guidellm-{len(backend)}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "--backend",
         ",".join(["kind=openai_http", f"target={server.url}", *backend]),
         "--profile", "kind=concurrent,streams=4",
         "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=12",
         "--constraint", "kind=max_requests,count=16", "--tokenizer",
         f"kind=huggingface_auto,model={path}", "--output", f"kind=json,path={out}",
         "--disable-console"],
        cwd=tmp_path, env={**ENV, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())["benchmarks"][0]


@pytest.mark.parametrize("request_format", ["default (chat)", "/v1/completions"])
def test_guidellm_runs_a_bounded_benchmark_without_errors(server, ckpts, tmp_path, request_format):
    extra = [] if request_format.startswith("default") else [f"request_format={request_format}"]
    bench = run_guidellm(server, ckpts["st_sharded"], tmp_path, *extra)
    state = bench["scheduler_state"]
    assert state["successful_requests"] == 16 and state["errored_requests"] == 0
    done = bench["requests"]["successful"]
    assert all(r["output_tokens"] == 12 for r in done)  # ignore_eos and max_tokens honoured
    assert all(r["prompt_tokens"] > 0 for r in done)  # usage came back


def test_litellm_openai_and_text_completion_routes(server):
    env = {**ENV, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    code = f"""
import json, litellm
base = {server.url + "/v1"!r}
chat = litellm.completion(model="openai/m", api_base=base, api_key="x", max_tokens=5,
                          messages=[{{"role": "user", "content": "hello"}}], temperature=0)
stream = litellm.completion(model="openai/m", api_base=base, api_key="x", max_tokens=5,
                            messages=[{{"role": "user", "content": "hello"}}], temperature=0,
                            stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in stream)
text = litellm.text_completion(model="text-completion-openai/m", api_base=base, api_key="x",
                               prompt="river king", max_tokens=5, temperature=0)
print(json.dumps({{"chat": chat.choices[0].message.content, "streamed": streamed,
                  "usage": chat.usage.completion_tokens, "text": text.choices[0].text}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["chat"] and out["chat"] == out["streamed"] and out["usage"] == 5
    import httpx

    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "river king",
                       "max_tokens": 5, "temperature": 0}).json()  # fmt: skip
    assert out["text"] == plain["choices"][0]["text"]
    assert os.environ.get("LITELLM_LOCAL_MODEL_COST_MAP") is None  # set for the child only


def test_the_tune_checks_leaders_against_the_models_reference_paths():
    """`bench kernels --tune` drops a leader whose output is off the reference by MAX_ERROR or
    more: the reference is the model's own CPU path (int8 and int4 layers with the fused GeLU
    and residual), and one flipped nibble of an int4 weight is far past that threshold."""
    import torch

    from mpinfer.model.kernels import epilogue
    from mpinfer.model.quant import quantize_int4, quantize_rows
    from mpinfer.tools.tunebench import MAX_ERROR, reference

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 256, generator=g), torch.randn(32, 256, generator=g)
    bias, res = torch.randn(32, generator=g), torch.randn(3, 32, generator=g)
    q, s = quantize_rows(w)
    want = epilogue(x @ (q.float() * s[:, None]).T + bias, gelu=True, residual=res)
    torch.testing.assert_close(reference(8, x, (q, s), bias, gelu=True, residual=res), want)
    packed, s4, o4 = quantize_int4(w, 128)
    ref4 = reference(4, x, (packed, s4, o4), bias, gelu=True, residual=res)
    off = reference(4, x, (packed ^ 0x10, s4, o4), bias, gelu=True, residual=res)
    assert (off - ref4).abs().max() / ref4.abs().max() > MAX_ERROR


def test_the_steady_rate_counts_only_the_tokens_inside_its_window():
    """A closed loop's steady figure leaves out the ramp and the drain: tokens streamed before
    or after the window do not count, and a chunk that carried two tokens counts two."""
    import random

    from mpinfer.tools.loadgen import steady_rate

    rng = random.Random()
    lo, hi = 10.0, 10.0 + rng.uniform(5, 20)
    results, inside = [{"error": "HTTP 503"}], 0.0
    for _ in range(rng.randint(5, 30)):
        times = sorted(rng.uniform(0, hi + 10) for _ in range(rng.randint(1, 40)))
        per_chunk = rng.choice([1, 2])
        results.append({"times": times, "output_tokens": per_chunk * len(times)})
        inside += per_chunk * sum(lo <= t < hi for t in times)
    assert steady_rate(results, lo, hi) == pytest.approx(inside / (hi - lo))
    assert steady_rate(results, hi, lo) is None


def test_the_steady_latencies_leave_out_the_ramp_queue():
    """Steady TTFT counts the requests sent inside the window, steady gaps the gaps with both
    ends inside it: a ramp request that waited long, or a gap across the window's edge, does
    not count; percentiles are those of the kept values."""
    import random

    from mpinfer.tools.loadgen import pct, steady_latency

    rng = random.Random()
    lo, hi = 10.0, 10.0 + rng.uniform(5, 20)
    results, ttft, gaps = [{"error": "HTTP 503"}], [], []
    for _ in range(rng.randint(5, 40)):
        start = rng.uniform(0, hi + 5)
        times = sorted(start + rng.uniform(0.01, 8) for _ in range(rng.randint(1, 30)))
        results.append({"start": start, "times": times, "output_tokens": len(times)})
        if lo <= start < hi:
            ttft.append((times[0] - start) * 1e3)
        gaps += [(b - a) * 1e3 for a, b in zip(times, times[1:]) if lo <= a and b < hi]
    got = steady_latency(results, lo, hi)
    assert got["steady_ttft_ms_p99"] == pct(ttft, 0.99)
    assert got["steady_ttft_ms_p50"] == pct(ttft, 0.5)
    assert got["steady_itl_ms_p99"] == pct(gaps, 0.99)
    before = {"start": lo - 1, "times": [hi - 0.5], "output_tokens": 1}  # a ramp request
    assert steady_latency([*results, before], lo, hi) == got


@pytest.mark.parametrize("flag,bad", [("--env", "NO_VALUE"), ("--set", "=1")])
def test_bench_budget_refuses_a_setting_without_a_name_and_value(flag, bad):
    """Checked before anything else (no GPU needed): the error names the option and the item."""
    cmd = [sys.executable, "-m", "mpinfer.cli", "bench", "budget", flag, bad]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{flag} {bad!r}: expected NAME=VALUE" in proc.stderr, proc.stderr


def test_bench_gpu_table_shows_a_dash_for_a_batch_it_did_not_run():
    """`bench gpu --batches 32` times batch 32 alone: its table gives that figure and a dash for
    the batch-1 columns (it raised KeyError, and the run's JSON, written beside the table, was
    lost with it)."""
    import random

    from mpinfer.tools.gpubench import markdown

    b32 = random.uniform(1, 9)
    row = {"row": "mpinfer-int8", "weight_GB": 8.1, "floor_ms": 2.7, "decode_ms": {32: b32},
           "prefill_ms": {512: 35.6, 2048: 57.0}, "prefill_TFLOPs": {2048: 434.0},
           "peak_GB": 11.4}  # fmt: skip
    result = {
        "ceilings": {"copy_bandwidth_GBps": 3020.0, "bf16_matmul_TFLOPs": 783.0},
        "machine": {"gpu": "GPU"},
        "shape": "bloom-7b1",
        "context": 128,
        "rows": [row],
    }
    line = markdown(result).splitlines()[-1]
    assert line.split(" | ")[3:7] == ["-", "-", f"{b32:.2f}", "-"], line


def test_the_load_generator_reads_a_phases_gc_pauses_off_the_servers_histogram(monkeypatch):
    """Collections between two readings of the server's /metrics page are counted by
    generation, with their time and how many took over 10 ms; before and after only differ by
    them. Real collections show the hook is installed; their durations come from a fake clock
    (random, on both sides of 10 ms and on the bound itself), so no machine's speed decides."""
    import gc
    import random

    from prometheus_client import CollectorRegistry, generate_latest

    from mpinfer.startup import heap
    from mpinfer.tools.loadgen import gc_pauses, parse_counters

    registry = CollectorRegistry()
    pauses = heap.GcPauses(registry)
    try:
        page = lambda: parse_counters(generate_latest(registry).decode())  # noqa: E731
        before = page()
        assert gc_pauses(before, before) == {
            "gc_collections": {"0": 0, "1": 0, "2": 0},
            "gc_pause_ms": 0.0,
            "gc_pauses_over_10ms": 0,
        }
        gc.collect(1)
        gc.collect()
        real = gc_pauses(before, page())
        assert real["gc_collections"]["1"] >= 1 and real["gc_collections"]["2"] >= 1, real
        rng, clock = random.Random(), [0.0]
        monkeypatch.setattr(heap.time, "perf_counter", lambda: clock[0])
        gc.disable()  # from here only the driven pauses: no real collection between the pages
        before, want = page(), {"0": 0, "1": 0, "2": 0}
        took = [rng.choice([0.01, rng.uniform(0, 0.02), rng.uniform(0.5, 2)]) for _ in range(40)]
        gens = [rng.randrange(3) for _ in took]
        for t, g in zip(took, gens):
            clock[0] = 0.0
            pauses._hook("start", {"generation": g})
            clock[0] = t
            pauses._hook("stop", {"generation": g})
            want[str(g)] += 1
        got = gc_pauses(before, page())
    finally:
        gc.enable()
        pauses.close()
    assert got["gc_collections"] == want
    assert got["gc_pauses_over_10ms"] == sum(t > 0.01 for t in took)
    assert abs(got["gc_pause_ms"] - 1e3 * sum(took)) < 1e-6
    assert pauses._hook not in gc.callbacks


def test_settle_freezes_what_start_up_left_unless_switched_off(monkeypatch):
    """`settle` takes every live object out of the collector's generations (a full collection
    then walks none of them); MPINFER_GC_FREEZE=0 leaves the heap as it was."""
    import gc

    from mpinfer.startup.heap import settle

    kept = [[i] for i in range(1000)]
    base = gc.get_freeze_count()
    try:
        monkeypatch.setenv("MPINFER_GC_FREEZE", "0")
        assert settle() == 0 and gc.get_freeze_count() == base
        assert any(o is kept for o in gc.get_objects())
        monkeypatch.delenv("MPINFER_GC_FREEZE")
        frozen = settle()
        assert frozen == gc.get_freeze_count() >= base + len(kept)
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_the_load_generator_drives_a_running_server_from_its_command_line(server, tmp_path):
    """`python -m mpinfer.tools.loadgen` against the suite's server: every request answered,
    the phase's JSON and table written, the collector's pauses of the phase among its figures
    (the first phase of a fresh process may see none, so their presence is what is checked)."""
    out = tmp_path / "phase.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mpinfer.tools.loadgen", "--url", server.url, "--clients", "3",
         "--seconds", "3", "--repeats", "1,2", "--outputs", "4,12", "--out", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    phase = json.loads(out.read_text())
    assert phase["requests"] >= 3 and phase["errors"] == 0, phase
    assert 4 <= phase["output_tokens"] / phase["requests"] <= 12
    assert set(phase["gc_collections"]) == {"0", "1", "2"} and phase["gc_pause_ms"] >= 0
    assert "| 3 clients |" in proc.stdout and out.with_suffix(".md").exists()
