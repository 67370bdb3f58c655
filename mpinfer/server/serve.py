"""`launch/serve.py` / `mpinfer serve`: the HTTP server on rank 0, the engine on every rank, and a
clean stop.

Rank 0 binds the port first (so /health answers 503 while the model loads), starts every rank's
engine (runtime.start) and runs it on its main thread; uvicorn runs on a second thread.
SIGTERM or SIGINT on rank 0: /health turns 503 and new requests get 503, in-flight ones finish
for up to `server.shutdown_timeout` seconds and are then cancelled, the engine sends its stop
step, every rank exits 0; a second signal ends rank 0 at once (exit 1). A signal while the model
loads aborts the load (exit 1). Other ranks ignore both signals (torchrun sends them to every
rank) and leave when rank 0 says stop. If any rank dies, the collectives on the others fail,
rank 0 marks itself failed (/health 503, in-flight requests get an error) and every process
exits non-zero. What is not here: the routes (routes.py), the launcher (launcher.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

import uvicorn

from ..config import RunConfig, add_config_args
from ..dist import DistContext, raise_everywhere
from ..startup.heap import GcPauses, settle
from ..startup.launcher import add_launch_args
from ..startup.runtime import (
    Interrupted,
    note_stop_signal,
    on_stop_signal,
    rank_config,
    run_rank,
    start,
)
from .chat import load_chat_template
from .guard import protocol_for
from .routes import build_app
from .streams import State

log = logging.getLogger("mpinfer")

EXAMPLE = """example:
  mpinfer serve --nproc 2 --config configs/tiny-cpu.toml      # then: curl 127.0.0.1:8080/health
  torchrun --nproc-per-node 8 launch/serve.py --config configs/bloom-176b-8x24gb.toml"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpinfer serve", description="serve HTTP on rank 0",
                                epilog=EXAMPLE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    add_launch_args(p)
    p.add_argument("--host", help="shortcut for --set server.host=")
    p.add_argument("--port", type=int, help="shortcut for --set server.port=")
    return p


def serve_main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cfg = rank_config(args)
    if cfg is None:
        return 2
    return run_rank(lambda ctx: serve_rank(cfg, ctx), cfg)


def start_http(state: State, cfg: RunConfig) -> tuple[uvicorn.Server, threading.Thread]:
    s = cfg.server
    config = uvicorn.Config(build_app(state), host=s.host, port=s.port, log_level="warning",
                            access_log=False, http=protocol_for(s, state.closed_connections),
                            h11_max_incomplete_event_size=s.max_header_bytes,
                            timeout_keep_alive=max(1, int(s.idle_timeout_s)))  # fmt: skip
    server = uvicorn.Server(config)
    logging.getLogger("uvicorn.error").addFilter(said_below)
    server.install_signal_handlers = lambda: None  # rank 0's main thread owns the signals
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise ValueError(f"could not serve on {cfg.server.host}:{cfg.server.port} (port in use?)")
    log.info("listening on %s (loading)", bound_url(server, s.host, s.port))
    return server, thread


def said_below(record: logging.LogRecord) -> bool:
    """uvicorn's own line for a port it cannot bind: start_http says it once, in our words."""
    return "error while attempting to bind" not in record.getMessage()


def bound_url(server: uvicorn.Server, host: str, port: int) -> str:
    """The address clients reach: with `server.port = 0` the one the OS picked."""
    for srv in getattr(server, "servers", []):
        for sock in srv.sockets or ():
            port = sock.getsockname()[1]
            break
    return f"http://{host}:{port}"


def serve_rank(cfg: RunConfig, ctx: DistContext) -> None:
    s = cfg.server
    if not ctx.is_rank0:
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop
            signal.signal(sig, note_stop_signal)
        raise_everywhere(None, ctx)  # rank 0's check of the chat template and the port
        start(cfg, ctx)
        return
    state = State(cfg, model_name=Path(cfg.model.path).name)
    GcPauses(state.registry)  # the process's collector pauses on /metrics

    def while_loading(signum, frame):
        state.status = "stopping"
        on_stop_signal(signum, frame)  # raises Interrupted: run_rank ends the rank in one line

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, while_loading)
    # A template that does not render, or a port in use, stops every rank before anything
    # loads: the other ranks wait for this verdict (under torchrun too, no rank left hanging).
    error, chat, http, thread = None, None, None, None
    try:
        try:
            chat = load_chat_template(cfg.model.path, s.chat_template)
            http, thread = start_http(state, cfg)
        except ValueError as e:
            error = str(e)
        raise_everywhere(error, ctx)
        engine = start(cfg, ctx)
        state.attach(engine, chat)
        settle()  # what start-up built, out of the collector's sight (heap.py)
        install_shutdown(state, engine, s.shutdown_timeout)
        state.status = "ready"
        log.info("ready: %s", bound_url(http, s.host, s.port))
        engine.run()
    except Interrupted as e:
        e.what = "stopped while loading, before serving"
        raise
    except BaseException:
        state.status = "failed"
        if http is not None:  # let in-flight requests deliver their error before it closes
            time.sleep(0.5)
        raise
    finally:
        if http is not None:
            http.should_exit = True
            thread.join(timeout=10)
    log.info("stopped")


def install_shutdown(state: State, engine, timeout_s: float) -> None:
    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        if state.status == "stopping":
            log.error("%s again: stopping now", name)
            logging.shutdown()
            os._exit(1)
        log.info("%s: draining (up to %.0f s), new requests get 503", name, timeout_s)
        state.status = "stopping"
        engine.stop()
        timer = threading.Timer(timeout_s, engine.cancel_all)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
