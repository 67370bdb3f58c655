"""`mpinfer serve|repl|generate --nproc N`: start the ranks of one host, and own their lifetime.

Each rank is `python -m mpinfer.cli SUBCOMMAND ...` with the environment torchrun would give it
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), in a session of its own so a
terminal's Ctrl-C reaches the launcher alone; rank 0 keeps the launcher's stdin. What a service
manager needs from it:

- SIGTERM or SIGINT: passed on to every rank as it came. Rank 0 decides: a server drains (up to
  `server.shutdown_timeout`) and tells the other ranks to stop, exit 0; `generate` ends its
  requests where they are, prints the text so far and exits 128 + the signal (130 for Ctrl-C);
  while loading every rank stops at once, with one line. The others note the signal and follow
  rank 0 (runtime.py); no rank prints a traceback. A second signal kills every rank at once and
  exits 128 + the signal's number (so does the first, on a host without rank 0).
- A rank that fails: the others get `grace_s` to notice (their collectives fail) before they are
  killed; the launcher exits with the first failure's status.
- The launcher killed outright: each rank notices its parent is gone and exits
  (runtime.watch_launcher).

Several hosts: `--nnodes N --node-rank R --master-addr HOST --master-port PORT` on each (ranks
R * nproc ... R * nproc + nproc - 1; HOST:PORT is node 0, where rank 0 listens). What is not
here: anything a rank does (runtime.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Topology:
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one host only)

    def check(self) -> Topology:
        if self.nproc < 1:
            raise ValueError(f"--nproc={self.nproc} must be >= 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in [0, --nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("--nnodes > 1 needs --master-addr and --master-port (node 0's)")
        return self


def free_port(*, below_ephemeral: bool = False) -> int:
    """A port nothing listens on now. `below_ephemeral`: one under the OS's ephemeral range, for
    a server's listening port that is chosen before the ranks start: a port the OS handed out
    and took back can be handed out again to the rendezvous store or a gloo connection before
    the server binds it (a test server once failed with "port in use" that way)."""
    if below_ephemeral:
        try:
            low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            low = 32768  # Linux's default; macOS's range starts at 49152
        hi = min(low, 32768)
        for port in random.sample(range(20000, hi), 200) if hi > 20200 else ():
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(topo: Topology, subcommand: str, argv: list[str], *, grace_s: float = 30.0) -> int:
    """Run this host's ranks of `mpinfer SUBCOMMAND argv` to the end; their exit status."""
    topo.check()
    port = topo.master_port or free_port()
    world = topo.nproc * topo.nnodes
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is None:  # torch's launcher would print a warning banner instead
        threads = str(max(1, (os.cpu_count() or 1) // topo.nproc))
        print(
            f"mpinfer: OMP_NUM_THREADS={threads} for each of {topo.nproc} ranks (the CPUs "
            "shared out; set OMP_NUM_THREADS to choose)",
            file=sys.stderr,
            flush=True,
        )
    procs = []
    for local in range(topo.nproc):
        rank = topo.node_rank * topo.nproc + local
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(topo.nproc),
            "GROUP_RANK": str(topo.node_rank),
            "MASTER_ADDR": topo.master_addr,
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": threads,
        }
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mpinfer.cli", subcommand, *argv], env=env,
            stdin=None if rank == 0 else subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
    signals: list[int] = []

    def on_signal(signum, _frame):
        signals.append(signum)
        if len(signals) == 1 and topo.node_rank == 0:
            # Every rank gets it: rank 0 decides (a server drains, generate keeps its text so
            # far); the others note it and stop when rank 0 says so, or quietly if it cannot.
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)
        else:  # a second signal, or a host without rank 0 (the job cannot go on without it)
            for p in procs:
                p.kill()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at, status = None, 0
        while any(p.poll() is None for p in procs):
            codes = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if codes and failed_at is None:
                failed_at, status = time.monotonic(), codes[0]
            # After a stop signal a rank that ended lets the others go at once (they are waiting
            # for it); otherwise they get grace_s to report their own error.
            grace = 3.0 if signals else grace_s
            if failed_at is not None and time.monotonic() - failed_at > grace:
                for p in procs:
                    p.kill()
            time.sleep(0.05)
        if len(signals) > 1 or (signals and topo.node_rank != 0):
            return 128 + signals[-1]
        bad = [p.returncode for p in procs if p.returncode != 0]
        code = status or (bad[0] if bad else 0)
        return code if code >= 0 else 128 - code  # -N: killed by signal N
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """The launcher's options (read by `main` before the subcommand runs; shown in its help)."""
    g = p.add_argument_group("starting the ranks (without torchrun)")
    g.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int,
                   help="start N ranks on this host (tp size N); --nproc-per-node is torchrun's "
                   "spelling of the same")  # fmt: skip
    g.add_argument("--nnodes", type=int, default=1, help="hosts in the job (default 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this host's index (0: rank 0's)")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    g.add_argument("--master-port", type=int, default=0, help="node 0's port (0: a free one)")
    g.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="the same as --master-addr HOST --master-port PORT (torchrun's name)",
    )
