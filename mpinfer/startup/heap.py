"""Python's garbage collector on a serving process: what start-up leaves is frozen, and every
collection's pause is timed.

    settle()     after start-up, on every rank: one full collection, then `gc.freeze()` moves
                 every object alive (torch, transformers, the model's modules, FastAPI: about
                 234,000 after the imports alone) out of the collector's sight. Without it
                 each full collection walks them all, every thread stopped meanwhile (the
                 engine's included): 150 ms on this project's 2-core CPU machine. Full
                 collections are rare under load (most objects die young), so this trims a
                 rare tail, not the typical step. `MPINFER_GC_FREEZE=0` skips it.
    GcPauses     a `gc.callbacks` hook timing each collection by generation, for /metrics
                 (`mpinfer_gc_pause_seconds`, a histogram labelled by generation, and
                 `mpinfer_gc_frozen_objects`, what settle froze); the load
                 generator reports each phase's pauses from it

What is not here: the metrics registry (server/streams.py).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import logging
import os
import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger("mpinfer")

PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def settle() -> int:
    """A full collection, then every surviving object frozen (unless MPINFER_GC_FREEZE=0):
    the objects frozen, 0 when skipped."""
    if os.environ.get("MPINFER_GC_FREEZE", "1") == "0":
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("gc: %d objects frozen after start-up (%.0f ms)", frozen,
              (time.perf_counter() - t0) * 1e3)  # fmt: skip
    return frozen


class GcPauses:
    """Times every collection of this process (any thread's) into a histogram by generation,
    a prometheus_client collector read when /metrics is scraped. `close()` removes the hook (a
    test's server, a second State in one process)."""

    def __init__(self, registry: CollectorRegistry):
        # per generation: pauses at or under each bound, then over the last; seconds in all.
        # Plain lists, no lock: the hook runs inside an allocation of any thread, possibly one
        # holding a metrics lock, so it must take none (and it allocates nothing to collect).
        self.counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(3)]
        self.sums = [0.0] * 3
        self.started = 0.0
        registry.register(self)
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        # Runs inside the collection, on whichever thread triggered it, with the GIL held: no
        # other thread can interleave between "start" and "stop", so one clock suffices.
        if phase == "start":
            self.started = time.perf_counter()
            return
        took, g = time.perf_counter() - self.started, info["generation"]
        self.counts[g][bisect.bisect_left(PAUSE_BUCKETS, took)] += 1
        self.sums[g] += took

    def collect(self):
        h = HistogramMetricFamily("mpinfer_gc_pause_seconds", "garbage-collector pauses of the "
                                  "server's process (every thread waits), by generation",
                                  labels=["generation"])  # fmt: skip
        for g in range(3):
            counts = list(itertools.accumulate(self.counts[g]))
            h.add_metric([str(g)], [*zip(map(str, PAUSE_BUCKETS), counts), ("+Inf", counts[-1])],
                         self.sums[g])  # fmt: skip
        yield h
        yield GaugeMetricFamily(
            "mpinfer_gc_frozen_objects",
            "objects start-up left, frozen out of the collector's walks (settle)",
            value=gc.get_freeze_count(),
        )

    def close(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)
