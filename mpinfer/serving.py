"""`launch/serve.py` / `mpinfer serve`: start the HTTP server on rank 0 and the engine on all
ranks, and shut both down cleanly.

Rank 0 binds the port first (so /health answers 503 while the model loads), loads, builds the
engine and runs it on its main thread; uvicorn runs on a second thread. SIGTERM or SIGINT on
rank 0: /health turns 503 and new requests get 503, in-flight ones finish for up to
`server.shutdown_timeout` seconds and are then cancelled, the engine sends its stop plan, every
rank exits 0. Other ranks ignore those signals (torchrun forwards them to every rank) and leave
when rank 0 says stop. If any rank dies, the collectives on the others fail, rank 0 marks
itself failed (/health 503, in-flight requests get an error) and every process exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from .config import add_config_args, config_from_args

log = logging.getLogger("mpinfer")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpinfer serve", description="serve HTTP on rank 0")
    add_config_args(p)
    p.add_argument("--host", help="shortcut for --set server.host=")
    p.add_argument("--port", type=int, help="shortcut for --set server.port=")
    return p


def serve_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.host:
        args.overrides.append(f'server.host="{args.host}"')
    if args.port is not None:
        args.overrides.append(f"server.port={args.port}")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .cli import run_rank

    return run_rank(lambda ctx: _serve(cfg, ctx), cfg)


def _start_http(state, cfg):
    import uvicorn

    from .server import build_app

    config = uvicorn.Config(build_app(state), host=cfg.server.host, port=cfg.server.port,
                            log_level="warning", access_log=False)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise ValueError(f"could not serve on {cfg.server.host}:{cfg.server.port} (port in use?)")
    log.info("listening on http://%s:%d (loading)", cfg.server.host, cfg.server.port)
    return server, thread


def _serve(cfg, ctx) -> None:
    from pathlib import Path

    from .cli import load_tokenizer
    from .engine import Engine, server_worker_loop
    from .loader import load_model
    from .server import State

    s = cfg.server
    if not ctx.is_rank0:
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop
            signal.signal(sig, lambda *_: log.info("signal ignored: rank 0 drives shutdown"))
        server_worker_loop(load_model(cfg, ctx), ctx, cfg)
        return
    state = State(cfg, model_name=Path(cfg.model.path).name)
    http, thread = _start_http(state, cfg)
    engine = None
    try:
        loaded = load_model(cfg, ctx)
        state.tokenizer = load_tokenizer(loaded.model_dir)
        engine = Engine.from_config(loaded, ctx, state.tokenizer, cfg)
        state.engine = engine
        state.info = {
            "tp_size": loaded.tp.tp_size, "quant": cfg.quant.method,
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "max_batch_slots": engine.cache.slots,
            "max_seq_len": s.max_seq_len, "max_queue": s.max_queue,
            "max_new_tokens_default": cfg.generation.max_new_tokens,
        }  # fmt: skip
        _install_shutdown(state, engine, s.shutdown_timeout)
        state.status = "ready"
        log.info("ready: http://%s:%d", s.host, s.port)
        engine.run()
    except BaseException:
        state.status = "failed"
        time.sleep(0.5)  # let in-flight requests deliver their error before the socket closes
        raise
    finally:
        http.should_exit = True
        thread.join(timeout=10)
    log.info("stopped")


def _install_shutdown(state, engine, timeout_s: float) -> None:
    def on_signal(signum, _frame):
        if state.status == "stopping":
            return
        log.info("%s: draining (up to %.0f s), new requests get 503",
                 signal.Signals(signum).name, timeout_s)  # fmt: skip
        state.status = "stopping"
        engine.stop()
        timer = threading.Timer(timeout_s, engine.cancel_all)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
