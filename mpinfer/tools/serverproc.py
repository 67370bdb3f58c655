"""A real server for the benchmarks and the tests: `mpinfer serve --nproc N` on 127.0.0.1
(`ServerProcess`), the wait for its /health (`wait_ready`), and bursts of streaming
/generate_stream clients (`load_phase`: tokens/s, time to first token, inter-token gaps). What
is not here: the benchmarks that use them (servebench.py on a CPU, servegpu.py on a GPU) and
the sustained mixed workload (loadgen.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from ..extras import require
from ..startup.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll `url`/health until it answers 200 (True), the launcher exits or `timeout` passes
    (False). Refused connections and 503s are what a loading server gives."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):  # not listening yet
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        time.sleep(0.2)
    return False


class ServerProcess:
    """`mpinfer serve --nproc N ...` on 127.0.0.1, ready when /health says so."""

    def __init__(self, nproc: int, model: str, *settings: str, timeout: float = 900,
                 env: dict | None = None):  # fmt: skip
        self.port = free_port(below_ephemeral=True)
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "mpinfer.cli",
            "serve",
            "--nproc",
            str(nproc),
            "--model",
            model,
            "--port",
            str(self.port),
            *[x for s in settings for x in ("--set", s)],
        ]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**ENV, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        if not wait_ready(self.url, self.proc, timeout):
            self.stop()
            raise RuntimeError("the server did not start:\n" + self.output()[-3000:])

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def rank0_pid(self) -> int:
        return psutil.Process(self.proc.pid).children()[0].pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)  # the second signal: at once
                self.proc.wait(timeout=30)
        return self.proc.returncode


async def stream_one(session, url: str, prompt: str, max_new: int) -> dict:
    """One streaming /generate_stream request: the arrival time of every token event."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new}}
    t0 = time.perf_counter()
    times = []
    async with session.post(url + "/generate_stream", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {await r.text()}"}
        async for line in r.content:
            if line.startswith(b"data:"):
                times.append(time.perf_counter())
                if b'"error"' in line[:20]:
                    return {"error": line.decode()}
    return {"start": t0, "times": times}


async def load_phase(url: str, clients: int, max_new: int) -> dict:
    """`clients` concurrent requests of `max_new` tokens: tokens/s over the phase, TTFT."""
    aiohttp = require("aiohttp")
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            stream_one(session, url, f"Request {i} about the river and the king of the city",
                       max_new)
            for i in range(clients)
        ])  # fmt: skip
        wall = time.perf_counter() - t0
    ok = [r for r in results if "times" in r]
    tokens = sum(len(r["times"]) for r in ok)
    ttft = sorted((r["times"][0] - r["start"]) * 1e3 for r in ok if r["times"])
    gaps = [(b - a) * 1e3 for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {
        "clients": clients,
        "max_new_tokens": max_new,
        "errors": len(results) - len(ok),
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "ttft_ms_median": statistics.median(ttft) if ttft else None,
        "ttft_ms_max": max(ttft) if ttft else None,
        "itl_ms_median": statistics.median(gaps) if gaps else None,
        "itl_ms_p90": statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 10 else None,
    }
