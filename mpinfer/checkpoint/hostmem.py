"""Host RAM while loading: the measurement and the one allocator setting that keeps it low.

`HostMemoryMonitor` samples this process's anonymous resident memory (RssAnon: heap and
anonymous mappings, not the page cache of mmap-ed checkpoint files, which the kernel can drop
at will) on a background thread, so a load can report its true peak. What is not here: GPU
memory (memory.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import re
import threading
import time
from pathlib import Path

_STATUS = Path("/proc/self/status")


def rss_anon_mib() -> float:
    """Current anonymous RSS in MiB (0 where /proc is not available)."""
    try:
        m = re.search(r"^RssAnon:\s+(\d+) kB", _STATUS.read_text(), re.M)
    except OSError:
        return 0.0
    return int(m.group(1)) / 1024 if m else 0.0


class HostMemoryMonitor:
    """Peak anonymous RSS between start() and stop(), sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.start_mib = self.peak_mib = rss_anon_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, rss_anon_mib())
            time.sleep(self.interval)

    def __enter__(self) -> HostMemoryMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end_mib = rss_anon_mib()
        self.peak_mib = max(self.peak_mib, self.end_mib)


def return_large_frees_to_os(threshold: int = 1 << 20) -> None:
    """Serve allocations >= `threshold` bytes by mmap, so freeing one returns it to the OS.

    glibc raises its mmap threshold after the first large free (up to 32 MiB); from then on the
    per-tensor buffers of a streaming load come from the heap and are never given back, and
    rank 0's RSS grows with the model (measured: +803 MiB instead of +173 MiB for a 0.5 GB
    checkpoint at tp=2). Fixing the threshold (M_MMAP_THRESHOLD = -3) turns that off.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return
    # Not glibc (musl, macOS): there is no such knob, and nothing to pin.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).mallopt(-3, threshold)
