"""Runs under torchrun (tp=2) for the engine tests: a sequence of engine scenarios on one set of
process groups; rank 0 writes what each produced as JSON.

    torchrun --standalone --nproc-per-node 2 tests/engine_worker.py MODEL_DIR OUT.json [fault]

With `fault`, rank 1's model raises on its third forward instead (the fault-injection test).
"""

import copy
import dataclasses
import json
import sys
import threading
import time

from mpinfer.checkpoint.loader import load_model
from mpinfer.config import load_config
from mpinfer.dist import init_distributed, teardown
from mpinfer.engine.engine import Engine
from mpinfer.engine.request import QueueFull
from mpinfer.engine.runner import ModelRunner, run_worker
from mpinfer.engine.sampling import SamplingParams
from mpinfer.startup.runtime import load_tokenizer

SLOTS, MAX_SEQ = 4, 96
PROMPTS = [
    "the capital of france is", "river", "a model token weight matrix rank group tensor server",
    "king queen", "water light people world time year number prompt answer question stream", "of",
    "paris city", "the of and to in is was for on that with as by at from it his an",
]  # fmt: skip
BUDGETS = [12, 20, 7, 16, 9, 14, 5, 11]


def collect(engine, prompt_ids, params, events=None):
    box = {}

    def sink(ev):
        if events is not None:
            events.append(ev)
        if ev.kind in ("done", "error"):
            box["result"] = ev.result
            box["error"] = ev.error

    req = engine.submit(prompt_ids, params, sink)
    return req, box


def as_dict(r):
    return dataclasses.asdict(r)


def scenarios(runner, ctx, tok):
    """Each yields an Engine that it drives with run(); the workers mirror with worker_loop."""
    enc = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    greedy = [SamplingParams(max_new_tokens=b) for b in BUDGETS]
    out = {}

    # 1. Each request alone, one after another.
    alone = []
    for ids, params in zip(enc, greedy):
        engine = Engine(runner, ctx, tok)
        _, box = collect(engine, ids, params)
        engine.run(until_idle=True)
        alone.append(as_dict(box["result"]))
    out["alone"] = alone

    # 2. All eight at once (4 slots: half wait in the queue, then join as others leave), plus a
    #    request that arrives while the first ones decode.
    engine = Engine(runner, ctx, tok)
    boxes = [collect(engine, ids, p)[1] for ids, p in zip(enc, greedy)]
    engine.run(until_idle=True)
    out["batched"] = [as_dict(b["result"]) for b in boxes]

    engine = Engine(runner, ctx, tok)
    first_events, late = [], {}

    def feeder():
        while sum(e.kind == "token" for e in first_events) < 4:
            time.sleep(0.001)
        late["box"] = collect(engine, enc[2], greedy[2])[1]

    _, first = collect(engine, enc[1], greedy[1], first_events)
    t = threading.Thread(target=feeder)
    t.start()
    engine.run(until_idle=True)
    t.join()
    out["join"] = {"first": as_dict(first["result"]), "late": as_dict(late["box"]["result"])}

    # 3. Seeded sampling alone, twice, and inside a batch of other sampled requests.
    sampled = SamplingParams(max_new_tokens=15, do_sample=True, temperature=0.9, top_k=50,
                             top_p=0.95, seed=1234)  # fmt: skip
    runs = []
    for others in (0, 0, 3):
        engine = Engine(runner, ctx, tok)
        for k in range(others):
            collect(engine, enc[3 + k], dataclasses.replace(sampled, seed=k))
        _, box = collect(engine, enc[0], sampled)
        engine.run(until_idle=True)
        runs.append(box["result"].token_ids)
    out["seeded"] = runs

    # 4. Stop strings: a stop made of the text of several generated tokens; events are recorded.
    ref = alone[0]
    pieces = [tok.decode([t]) for t in ref["token_ids"]]
    stop = "".join(pieces[3:6])
    engine = Engine(runner, ctx, tok)
    events = []
    _, box = collect(engine, enc[0], dataclasses.replace(greedy[0], stop=(stop, "\u2603")), events)
    engine.run(until_idle=True)
    out["stop"] = {
        "stop": stop,
        "result": as_dict(box["result"]),
        "streamed": "".join(e.text for e in events),
        "deltas": [e.text for e in events],
    }

    # 5. EOS: pretend the 4th greedy token is EOS.
    eos = ref["token_ids"][3]
    eos_runner = copy.copy(runner)  # the same cache and graphs, a model whose EOS is `eos`
    eos_runner.loaded = dataclasses.replace(
        runner.loaded, shape=dataclasses.replace(runner.loaded.shape, eos_token_id=eos)
    )
    engine = Engine(eos_runner, ctx, tok)
    _, box = collect(engine, enc[0], greedy[0])
    engine.run(until_idle=True)
    out["eos"] = {"eos": eos, "result": as_dict(box["result"])}

    # 6. Cancel a long request after two tokens; its slot is free at the next step.
    engine = Engine(runner, ctx, tok)
    events = []
    req, box = collect(engine, enc[0], SamplingParams(max_new_tokens=60), events)

    def canceller():
        while sum(e.kind == "token" for e in events) < 2:
            time.sleep(0.001)
        engine.cancel(req)

    t = threading.Thread(target=canceller)
    t.start()
    engine.run(until_idle=True)
    t.join()
    out["cancel"] = {"result": as_dict(box["result"]), "free": len(engine.scheduler.free),
                     "running": engine.running_slots}  # fmt: skip

    # 7. A full queue rejects with a clear error (no run needed; stop ends the workers' loop).
    engine = Engine(runner, ctx, tok, max_queue=2)
    collect(engine, enc[0], greedy[0])
    collect(engine, enc[1], greedy[1])
    try:
        collect(engine, enc[2], greedy[2])
        out["queue_full"] = ""
    except QueueFull as e:
        out["queue_full"] = str(e)
    try:
        collect(engine, enc[2], SamplingParams(max_new_tokens=MAX_SEQ))
        out["too_long"] = ""
    except ValueError as e:
        out["too_long"] = str(e)
    engine.run(until_idle=True)

    # 8. Chunked prefill: a 60-token prompt arrives while a request decodes; with 16 prompt
    #    tokens a step, the decoding request still gets a token every step.
    long_ids = (enc[7] * 4)[:60]
    # prompt_logprobs too: each chunk's positions, their ranks and alternatives
    scored = SamplingParams(max_new_tokens=5, prompt_logprobs=2)
    engine = Engine(runner, ctx, tok, max_prefill_tokens=16)
    _, box = collect(engine, long_ids, scored)
    engine.run(until_idle=True)
    long_alone = as_dict(box["result"])
    engine = Engine(runner, ctx, tok, max_prefill_tokens=16)
    first_events, late = [], {}

    def feeder2():
        while sum(e.kind == "token" for e in first_events) < 2:
            time.sleep(0.001)
        late["box"] = collect(engine, long_ids, scored)[1]

    _, first = collect(engine, enc[1], SamplingParams(max_new_tokens=20), first_events)
    t = threading.Thread(target=feeder2)
    t.start()
    engine.run(until_idle=True)
    t.join()
    # The same prompt whole, in one step (a budget above its length): the same tokens.
    engine = Engine(runner, ctx, tok, max_prefill_tokens=64)
    _, box = collect(engine, long_ids, scored)
    engine.run(until_idle=True)
    out["chunked"] = {"long_alone": long_alone, "long": as_dict(late["box"]["result"]),
                      "decoding": as_dict(first["result"]), "whole": as_dict(box["result"]),
                      "steps_whole": engine.steps}  # fmt: skip

    # 8b. Cancelled mid-prompt (4 tokens a step, 60 to go): it ends at once with no token, its
    #     slot is free, and a request beside it is untouched.
    engine = Engine(runner, ctx, tok, max_prefill_tokens=4)
    req, box = collect(engine, long_ids, SamplingParams(max_new_tokens=5))
    _, other = collect(engine, enc[1], greedy[1])
    launch = engine._launch_next

    def cancel_after_two_steps():
        if engine.steps == 2:
            engine.cancel(req)
        return launch()

    engine._launch_next = cancel_after_two_steps
    engine.run(until_idle=True)
    out["cancel_mid_prompt"] = {"result": as_dict(box["result"]),
                                "free": len(engine.scheduler.free), "steps": engine.steps,
                                "other": as_dict(other["result"])}  # fmt: skip

    # 9. A request whose sink raises on its third token fails alone: the others in its batch
    #    finish as they do alone, and the engine goes on.
    engine = Engine(runner, ctx, tok)
    seen = []

    def faulty_sink(ev):
        seen.append(ev)
        if ev.kind == "token" and sum(e.kind == "token" for e in seen) == 3:
            raise RuntimeError("the client's sink broke")

    victim = engine.submit(enc[0], greedy[0], faulty_sink)
    boxes = [collect(engine, enc[i], greedy[i])[1] for i in (1, 2, 3)]
    engine.run(until_idle=True)
    out["sink_fault"] = {"victim": [e.kind for e in seen], "victim_error": seen[-1].error,
                         "others": [as_dict(b["result"]) for b in boxes],
                         "free": len(engine.scheduler.free), "victim_id": victim.id}  # fmt: skip

    # 10. NaN logits in one request's row (as a broken kernel would give): that request ends
    #     with an error, the rows beside it are untouched.
    engine = Engine(runner, ctx, tok)
    execute = runner.execute
    state = {"poison": True}

    def poisoned(step, on_prompt_logits=None):
        logits = execute(step, on_prompt_logits)
        if state["poison"] and 0 in step.decode_slots:
            logits = logits.clone()
            logits[step.decode_slots.index(0)] = float("nan")
        return logits

    runner.execute = poisoned
    box_victim = collect(engine, enc[0], greedy[0])[1]
    boxes = [collect(engine, enc[i], greedy[i])[1] for i in (1, 2)]
    engine.run(until_idle=True)
    runner.execute = execute
    out["nan_row"] = {"victim_error": box_victim.get("error", ""),
                      "victim_result": as_dict(box_victim["result"]) if box_victim.get(
                          "result") else None,
                      "others": [as_dict(b["result"]) for b in boxes],
                      "failed": engine.failed_requests,
                      "free": len(engine.scheduler.free)}  # fmt: skip
    return out


N_SCENARIOS = 8 + 1 + 1 + 3 + 1 + 1 + 1 + 1 + 2 + 1 + 1 + 2


def preemption(runner, small, ctx, tok, out):
    """The eight prompts with longer budgets (and every third one sampled with penalties) on a
    pool of 12 blocks of 8 tokens for 4 rows: decodes run out of blocks, the newest sequences
    are preempted and recomputed; every rank applies the same block tables."""
    enc = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=b + 20, ignore_eos=True, do_sample=i % 3 == 2,
                             temperature=0.8, repetition_penalty=1.2 if i % 3 == 2 else 1.0,
                             seed=i) for i, b in enumerate(BUDGETS)]  # fmt: skip
    ref = Engine(runner, ctx, tok)  # the same requests on the full pool: no preemption
    ref_boxes = [collect(ref, ids, p)[1] for ids, p in zip(enc, params)]
    ref.run(until_idle=True)
    engine = Engine(small, ctx, tok)
    boxes = [collect(engine, ids, p)[1] for ids, p in zip(enc, params)]
    engine.run(until_idle=True)
    out["preempted"] = {"results": [as_dict(b["result"]) for b in boxes],
                        "reference": [as_dict(b["result"]) for b in ref_boxes],
                        "reference_preemptions": ref.scheduler.blocks.preemptions,
                        "preemptions": engine.scheduler.blocks.preemptions,
                        "available": engine.scheduler.blocks.pool.available,
                        "blocks": small.num_blocks,
                        "params": [dataclasses.asdict(p) for p in params]}  # fmt: skip


def main(model_dir, out_path, fault=False):
    cfg = load_config(None, [f'model.path="{model_dir}"', 'quant.method="none"',
                             "parallel.timeout_s=30"])  # fmt: skip
    ctx = init_distributed(timeout_s=cfg.parallel.timeout_s)
    try:
        loaded = load_model(cfg, ctx)
        runner = ModelRunner(loaded, ctx, slots=SLOTS, max_seq=MAX_SEQ)
        small = ModelRunner(loaded, ctx, slots=SLOTS, max_seq=MAX_SEQ, block_size=8, num_blocks=12)
        if fault and ctx.rank == 1:
            calls = {"n": 0}
            forward = loaded.model.forward_flat

            def faulty(*a, **k):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("injected fault in rank 1's step")
                return forward(*a, **k)

            loaded.model.forward_flat = faulty
        if ctx.is_rank0:
            tok = load_tokenizer(model_dir)
            out = scenarios(runner, ctx, tok)
            if not fault:
                preemption(runner, small, ctx, tok, out)
            with open(out_path, "w") as f:
                json.dump(out, f)
        else:
            for _ in range(N_SCENARIOS + (0 if fault else 1)):
                run_worker(runner)
            if not fault:
                run_worker(small)
    finally:
        teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], fault=len(sys.argv) > 3)
