"""Sustained traffic for `mpinfer bench serve --gpu`: what a served model sees in production,
rather than one synchronized burst.

The mix (seeded, the same every run): a request's prompt is a 9-word sentence repeated k times,
k drawn from {1, 4, 16, 64} (about 20 to 1,400 tokens with the random checkpoint's tokenizer),
and its output length is drawn uniformly from 32..256 tokens (`ignore_eos`, so every request
produces exactly what it asked for). Two ways to drive it:

    closed loop   N clients, each sending its next request as soon as the last one ends, for a
                  fixed time (the load a fixed pool of users or workers puts on a server)
    open loop     requests arriving as a Poisson process at a given rate, whatever the server's
                  pace (the load of many independent users), one phase per rate

Any running server can be driven with it: `python -m mpinfer.tools.loadgen --url
http://127.0.0.1:8080 --clients 32 --seconds 60` (a closed loop; `--rate R` an open one,
`--system-words N` a shared opening) prints the phase's table and writes its JSON.

Each phase reports output tokens/s, time to first token p50/p99, inter-token gap p50/p99, the
prompt tokens per output token of what actually ran, the prefix cache's hit rate over the phase
(the server's own counters: prompt tokens found in the cache over those looked up; the mix's
unique openings keep it near 0, `system` gives every prompt one shared opening), the server
process's garbage-collector pauses over the phase (its /metrics: ms in all, and how many took
over 10 ms, when every thread of the server stood still), and GPU
utilization and memory (NVML, sampled every 100 ms) when nvidia-ml-py is installed.
`ideal_tok_s` is what that mix allows on this engine: 1 / (prompt tokens per output token /
prefill tokens/s + batch-32 step / 32), prefill work counted once at full prefill speed, decode
at the batch-32 graph step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time

import httpx

from .report import md_table, save_result

WORDS = "the river runs past the old stone bridge tonight".split()
REPEATS = (1, 4, 16, 64)
OUTPUT_RANGE = (32, 256)


def mixed_requests(n: int, seed: int = 0, *, system: str = "", repeats=REPEATS,
                   outputs=OUTPUT_RANGE) -> list[tuple[str, int]]:  # fmt: skip
    """n (prompt, max_new_tokens) pairs of the mix; request i differs from the others in its
    first word after `system` (a shared opening, "" for none), so no two prompts are the same."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice(repeats)
        text = system + f"request {i}: " + " ".join(WORDS * k)
        out.append((text, rng.randint(*outputs)))
    return out


def system_prompt(words: int = 1000, seed: int = 7) -> str:
    """A long shared opening (a chat's system prompt): `words` words, the same every run."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words)) + "\n"


def server_counters(url: str) -> dict[str, float]:
    """The server's cumulative counters a phase's figures are differences of, from /metrics:
    prompt tokens looked up in the prefix cache and found there, and the garbage collector's
    pauses by generation (count, seconds, and how many took 10 ms or less)."""
    return parse_counters(httpx.get(url + "/metrics", timeout=10).text)


def parse_counters(page: str) -> dict[str, float]:
    """`server_counters` from a /metrics page's text (names with their labels as keys)."""
    got = {}
    for line in page.splitlines():
        if line.startswith(("mpinfer_prefix_cache_", "mpinfer_gc_pause_seconds_")):
            name, value = line.rsplit(" ", 1)
            got[name] = float(value)
    return got


def hit_rate(before: dict, after: dict) -> float | None:
    """The prefix cache's hit rate between two `server_counters`."""
    q, h = "mpinfer_prefix_cache_queried_tokens_total", "mpinfer_prefix_cache_hit_tokens_total"
    queried = after.get(q, 0.0) - before.get(q, 0.0)
    return (after.get(h, 0.0) - before.get(h, 0.0)) / queried if queried else None


def gc_pauses(before: dict, after: dict) -> dict:
    """The garbage collector's pauses between two `server_counters`: collections by generation,
    their total ms, and how many took over 10 ms (every thread waits through each: the engine's
    steps and the streams' writes)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    count, total, over = {}, 0.0, 0
    for g in range(3):
        label = f'{{generation="{g}"}}'
        count[str(g)] = int(delta("mpinfer_gc_pause_seconds_count" + label))
        total += delta("mpinfer_gc_pause_seconds_sum" + label)
        short = delta(f'mpinfer_gc_pause_seconds_bucket{{generation="{g}",le="0.01"}}')
        over += count[str(g)] - int(short)
    return {"gc_collections": count, "gc_pause_ms": total * 1e3, "gc_pauses_over_10ms": over}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class GpuSampler:
    """GPU utilization and memory every 100 ms on a thread, while a phase runs (NVML). The
    memory is the whole device's, every process on it: the server may be anywhere, so its own
    footprint is `mpinfer bench budget`'s (budgetbench.ProcessMemory)."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML (a CPU machine, or nvidia-ml-py missing): no GPU columns
            self.nvml = None
        self.util, self.mem, self.stop = [], [], threading.Event()

    def __enter__(self):
        if self.nvml is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(0.1):
            self.util.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            self.mem.append(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**30)

    def __exit__(self, *exc):
        self.stop.set()

    def summary(self) -> dict:
        if not self.util:
            return {"gpu_util_pct": None, "gpu_mem_gib": None}
        return {"gpu_util_pct": statistics.mean(self.util), "gpu_mem_gib": max(self.mem)}


async def one_request(session, url: str, prompt: str, max_new: int) -> dict:
    """A streaming /v1/completions request (what vLLM's and guidellm's load generators send,
    `ignore_eos` included): when each chunk arrived, and the usage the server counted."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_new, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    times, usage = [], None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": str(chunk["error"])[:200]}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):
                    times.append(time.perf_counter())
    except Exception as e:  # a connection fault is counted as an error of this request
        return {"error": f"{type(e).__name__}: {e}"}
    if usage is None:
        return {"error": "no usage chunk"}
    return {"start": t0, "times": times, "prompt_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"]}  # fmt: skip


def steady_rate(results: list[dict], lo: float, hi: float) -> float | None:
    """Output tokens a second that arrived between the clock times `lo` and `hi`: the rate
    while every client is busy, without the ramp (every client's first prompt at once) or the
    drain (the last requests finishing with fewer beside them) that a phase's whole wall time
    holds. A chunk counts its request's tokens per chunk (one, unless a token's text was
    incomplete and rode in the next chunk)."""
    if hi <= lo:
        return None
    tokens = 0.0
    for r in results:
        if r.get("times"):
            per_chunk = r["output_tokens"] / len(r["times"])
            tokens += per_chunk * sum(lo <= t < hi for t in r["times"])
    return tokens / (hi - lo)


def steady_latency(results: list[dict], lo: float, hi: float) -> dict:
    """TTFT of the requests sent between the clock times `lo` and `hi`, and the inter-token
    gaps with both ends in that window (ms, p50 and p99): the latencies of the steady state,
    without the ramp's queue (a closed loop's first requests all arrive at once)."""
    ok = [r for r in results if r.get("times")]
    ttft = [(r["times"][0] - r["start"]) * 1e3 for r in ok if lo <= r["start"] < hi]
    gaps = [(b - a) * 1e3 for r in ok for a, b in zip(r["times"], r["times"][1:])
            if lo <= a and b < hi]  # fmt: skip
    return {"steady_ttft_ms_p50": pct(ttft, 0.5), "steady_ttft_ms_p99": pct(ttft, 0.99),
            "steady_itl_ms_p50": pct(gaps, 0.5), "steady_itl_ms_p99": pct(gaps, 0.99)}  # fmt: skip


def summarize(results: list[dict], wall: float) -> dict:
    """A phase's figures; inter-token gaps are between streamed chunks (a token whose text is
    still incomplete rides in the next chunk)."""
    ok = [r for r in results if "times" in r and r["times"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    ttft = [(r["times"][0] - r["start"]) * 1e3 for r in ok]
    gaps = [(b - a) * 1e3 for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "output_tokens": out_tokens,
        "prompt_per_output": prompt_tokens / max(out_tokens, 1),
        "wall_s": wall,
        "tok_per_s": out_tokens / wall,
        "ttft_ms_p50": pct(ttft, 0.5),
        "ttft_ms_p99": pct(ttft, 0.99),
        "itl_ms_p50": pct(gaps, 0.5),
        "itl_ms_p99": pct(gaps, 0.99),
    }


async def closed_loop(url: str, clients: int, seconds: float, seed: int = 0, *,
                      work: list[tuple[str, int]] | None = None) -> dict:  # fmt: skip
    """`clients` clients each sending the mix's next request (or `work`'s) as soon as its last
    one ended; requests still running at the end are waited for, and counted (the wall time
    covers them). `steady_tok_per_s`: the rate over the last three quarters of the `seconds`,
    when every client has a request in flight (steady_rate); `steady_*_ms_*` the latencies of
    that window (steady_latency)."""
    import aiohttp

    work = work or mixed_requests(100_000, seed)
    counters = server_counters(url)
    cursor = iter(range(len(work)))
    results: list[dict] = []
    stop_at = time.perf_counter() + seconds

    async def client(session):
        while time.perf_counter() < stop_at:
            i = next(cursor, None)
            if i is None:  # the work list ran out before the time did
                return
            prompt, max_new = work[i]
            results.append(await one_request(session, url, prompt, max_new))

    timeout = aiohttp.ClientTimeout(total=900)
    with GpuSampler() as gpu:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0 = time.perf_counter()
            await asyncio.gather(*[client(session) for _ in range(clients)])
            wall = time.perf_counter() - t0
    return {
        "mode": "closed",
        "clients": clients,
        **summarize(results, wall),
        "steady_tok_per_s": steady_rate(results, t0 + seconds / 4, stop_at),
        **steady_latency(results, t0 + seconds / 4, stop_at),
        **phase_counters(counters, url),
        **gpu.summary(),
    }


def phase_counters(before: dict, url: str) -> dict:
    after = server_counters(url)
    return {"prefix_hit_rate": hit_rate(before, after), **gc_pauses(before, after)}


async def open_loop(url: str, rate: float, seconds: float, seed: int = 0, *,
                    work: list[tuple[str, int]] | None = None) -> dict:  # fmt: skip
    """Requests of the mix (or `work`) arriving as a Poisson process of `rate` per second for
    `seconds`."""
    import aiohttp

    rng = random.Random(seed + 1)
    work = work or mixed_requests(100_000, seed)
    counters = server_counters(url)
    tasks = []
    timeout = aiohttp.ClientTimeout(total=900)
    with GpuSampler() as gpu:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0 = time.perf_counter()
            i = 0
            while time.perf_counter() - t0 < seconds:
                prompt, max_new = work[i]
                i += 1
                tasks.append(asyncio.create_task(one_request(session, url, prompt, max_new)))
                await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
    return {
        "mode": "poisson",
        "rate": rate,
        **summarize(list(results), wall),
        **phase_counters(counters, url),
        **gpu.summary(),
    }


def ideal_tok_s(prompt_per_output: float, prefill_tok_s: float, step_ms_b32: float) -> float:
    return 1 / (prompt_per_output / prefill_tok_s + step_ms_b32 / 1e3 / 32)


def phase_row(name: str, p: dict, ideal: float | None) -> list:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    return [name, f"{p['tok_per_s']:.0f}", f(p.get("steady_tok_per_s"), ".0f"),
            f(ideal and p["tok_per_s"] / ideal, ".2f"),
            f(p.get("prefix_hit_rate"), ".2f"),
            f(p["ttft_ms_p50"], ".0f"), f(p["ttft_ms_p99"], ".0f"),
            f(p.get("steady_ttft_ms_p99"), ".0f"), f(p["itl_ms_p50"], ".1f"),
            f(p["itl_ms_p99"], ".1f"), f(p.get("steady_itl_ms_p99"), ".1f"),
            f"{p['prompt_per_output']:.2f}", f(p["gpu_util_pct"], ".0f"),
            f(p["gpu_mem_gib"], ".1f"), gc_cell(p), p["errors"]]  # fmt: skip


def gc_cell(p: dict) -> str:
    """A phase's GC pauses: total ms (pauses over 10 ms)."""
    if "gc_pause_ms" not in p:
        return "-"
    return f"{p['gc_pause_ms']:.0f} ({p['gc_pauses_over_10ms']})"


PHASE_HEADER = ["load", "output tok/s", "steady tok/s", "/ ideal", "prefix hit rate",
                "TTFT p50 ms", "TTFT p99 ms", "steady TTFT p99", "ITL p50 ms", "ITL p99 ms",
                "steady ITL p99", "prompt/output", "GPU util %", "device GiB (all processes)",
                "GC pause ms (> 10 ms)", "errors"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpinfer.tools.loadgen",
                                description="the mix against a running server")  # fmt: skip
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    p.add_argument("--rate", type=float, help="an open loop at this many requests a second")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--system-words", type=int, default=0, help="a shared opening this long")
    p.add_argument(
        "--repeats",
        default=",".join(map(str, REPEATS)),
        help="a prompt's sentence is repeated one of these many times",
    )
    p.add_argument(
        "--outputs",
        default=",".join(map(str, OUTPUT_RANGE)),
        help="new tokens a request, drawn uniformly from LO,HI",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/loadgen.json")
    a = p.parse_args(argv)
    system = system_prompt(a.system_words) if a.system_words else ""
    work = mixed_requests(100_000, a.seed, system=system,
                          repeats=[int(k) for k in a.repeats.split(",")],
                          outputs=tuple(int(n) for n in a.outputs.split(",")))  # fmt: skip
    if a.rate:
        phase = asyncio.run(open_loop(a.url, a.rate, a.seconds, a.seed, work=work))
    else:
        phase = asyncio.run(closed_loop(a.url, a.clients, a.seconds, a.seed, work=work))
    name = f"{a.rate} req/s" if a.rate else f"{a.clients} clients"
    save_result(phase, a.out, md_table(PHASE_HEADER, [phase_row(name, phase, None)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
