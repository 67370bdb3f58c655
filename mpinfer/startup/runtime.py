"""Start-up and teardown of a rank, written once for every face (server, REPL, generate).

    run_rank(work, cfg)   init the process groups, watch the launcher, run work(ctx), tear down;
                          a user error (ValueError) ends every rank with exit 1 and its message;
                          SIGINT/SIGTERM before a face takes them over ends the rank quietly
                          (one line, exit 128 + the signal: 130 for Ctrl-C)
    prepare(cfg, ctx)     load the model, allocate a first KV pool, warm up and capture the
                          step graphs (collectives, on every rank at this same point)
    start(cfg, ctx)       prepare; rank 0 gets the Engine and warms it up, then every rank
                          sizes the KV pool from what its process holds under the budget
                          (runner.fit_cache); the other ranks run the worker loop until rank 0
                          stops
    rank_config(args)     the run's config, or None after one line (from the first rank alone)
    load_tokenizer, default_params   the tokenizer file; the config's [generation] defaults,
                          the one place every face takes them from

What is not here: the faces themselves (serve.py, repl.py, cli.py), the launcher that starts the
ranks (launcher.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..checkpoint.hf import read_config
from ..checkpoint.loader import load_model
from ..config import RunConfig, config_from_args
from ..dist import DistContext, SharedError, init_distributed, raise_everywhere, teardown
from ..engine.engine import Engine
from ..engine.runner import ModelRunner, run_worker
from ..engine.sampling import SamplingParams
from ..engine.step import CacheFit
from ..model.memory import budget_bytes, cpu_blocks, memory_margin, provisional_blocks
from .heap import settle

# The caching allocator in expandable segments, unless the user configured it: a fixed segment
# that still holds one live tensor stays reserved whole, which the KV pool's fit counts as held
# (H100, bloom-7b1 with every block in host memory and int8 embeddings: 5,944 MiB reserved for
# 2,355 allocated after loading, so a 6 GiB budget had no room for a cache; with expandable
# segments 2,390, and the server was ready at 5,578 MiB). Read at the first CUDA allocation.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

log = logging.getLogger("mpinfer")


def rank_config(args) -> RunConfig | None:
    """The config the flags give, or None after saying what is wrong with it: once, from the
    first rank (under torchrun every rank reads the same flags and finds the same mistake)."""
    try:
        return config_from_args(args)
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return None


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The model directory's fast tokenizer; a ValueError naming the directory or the file."""
    read_config(model_dir)  # a missing directory is the error to report, not its tokenizer
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: mpinfer needs the model's fast tokenizer file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own types for a bad file
        raise ValueError(f"{path} is not a tokenizer file: {str(e)[:200]}") from None


def default_params(cfg: RunConfig, **overrides) -> SamplingParams:
    """The config's [generation] section as SamplingParams, with `overrides` on top."""
    g = cfg.generation
    params = SamplingParams(
        max_new_tokens=g.max_new_tokens, do_sample=g.do_sample, temperature=g.temperature,
        top_k=g.top_k, top_p=g.top_p, typical_p=g.typical_p,
        repetition_penalty=g.repetition_penalty, seed=None if g.seed < 0 else g.seed,
    )  # fmt: skip
    return dataclasses.replace(params, **{k: v for k, v in overrides.items() if v is not None})


def watch_launcher(interval: float = 0.5) -> None:
    """A rank started by a launcher (torchrun or `mpinfer --nproc`) ends when the launcher
    does, however it ends (SIGKILL included): a thread notices the parent is gone and exits
    the process. Ranks on other hosts then fail on their next collective."""
    if "LOCAL_RANK" not in os.environ:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        log.error("the launcher (pid %d) is gone: exiting", parent)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


class Interrupted(BaseException):
    """A stop signal (SIGINT, SIGTERM) reached this rank where nothing else handles it: not an
    Exception, so no `except Exception` of the work swallows it."""

    def __init__(self, signum: int, what: str = "stopped"):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.what = signum, what


STOP_SIGNALS: list[int] = []  # the stop signals this rank has seen, first first


def on_stop_signal(signum, _frame) -> None:
    """The default: note the signal and end the rank's work (run_rank says so in one line)."""
    STOP_SIGNALS.append(signum)
    raise Interrupted(signum)


def note_stop_signal(signum, _frame) -> None:
    """Ranks other than 0 once serving: rank 0 decides when to stop; the signal is noted, so a
    collective that fails because rank 0 went away ends this rank quietly too."""
    STOP_SIGNALS.append(signum)


def run_rank(work: Callable[[DistContext], int | None], cfg: RunConfig) -> int:
    """Init the process groups, run `work(ctx)` (its int, if it returns one, is the exit code),
    tear down; user errors exit 1 on every rank, a stop signal 128 + its number, in one line."""
    watch_launcher()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_stop_signal)
    ctx = init_distributed(timeout_s=cfg.parallel.timeout_s)
    try:
        return work(ctx) or 0
    except ValueError as e:
        if ctx.is_rank0 or not isinstance(e, SharedError):  # one rank's own error: its own line
            log.error("%s", e)
        return 1
    except Interrupted as e:
        if ctx.is_rank0:
            log.warning("%s: %s", e, e.what)
        return 128 + e.signum
    except Exception as e:
        if not STOP_SIGNALS:
            raise
        # A peer stopped by the same signal: what this rank was waiting for cannot come.
        log.debug("after %s: %s", signal.Signals(STOP_SIGNALS[0]).name, e)
        return 128 + STOP_SIGNALS[0]
    finally:
        teardown()


def prepare(cfg: RunConfig, ctx: DistContext, *, slots: int | None = None,
            max_seq: int | None = None) -> ModelRunner:  # fmt: skip
    """Every rank: check the tokenizer (rank 0), load, size the KV cache, capture the graphs."""
    error = None
    if ctx.is_rank0:
        try:
            load_tokenizer(cfg.model.path)
            if read_config(cfg.model.path).get("mpinfer_random_weights"):
                log.warning("%s holds random weights (mpinfer make-tiny): the text it writes is "
                            "meaningless; for a real model pass --model /path/to/bloom (an HF "
                            "checkpoint directory)", cfg.model.path)  # fmt: skip
        except ValueError as e:
            error = str(e)
    raise_everywhere(error, ctx)  # before any weight moves
    return runner_for(load_model(cfg, ctx), cfg, ctx, slots=slots, max_seq=max_seq)


def runner_for(loaded, cfg: RunConfig, ctx: DistContext, *, slots: int | None = None,
               max_seq: int | None = None) -> ModelRunner:  # fmt: skip
    """`prepare` after the load (or around a model built in place: tools/diag): the KV cache's
    first pool and its fit to the budget, the graphs."""
    if loaded.device.type == "cuda":
        # The loader's freed temporaries would stay reserved, which the KV pool's fit counts as
        # held (H100, bloom-7b1 with every block in host memory: 13,784 MiB reserved, 2,355 used)
        torch.cuda.empty_cache()
    cfg = loaded.cfg or cfg  # a model over its budget: the throughput plan's rows and KV
    s = cfg.server
    if max_seq:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(s, max_seq_len=max_seq))
        s = cfg.server
    slots = slots or s.max_batch_slots
    gpu = loaded.device.type == "cuda"
    blocks = provisional_blocks(cfg, slots) if gpu else cpu_blocks(cfg, slots)
    bs = min(s.kv_block_size, s.max_seq_len)
    if blocks * bs < s.max_seq_len:
        raise ValueError(f"no room for a KV cache of one max_seq_len={s.max_seq_len} sequence "
                         f"({blocks} blocks of {bs} tokens): raise server.kv_cache_tokens or "
                         "lower server.max_seq_len")  # fmt: skip
    fit = CacheFit(budget_bytes(cfg, loaded.device) or 0, memory_margin(cfg),
                   s.kv_cache_tokens // bs) if gpu else None  # fmt: skip
    return ModelRunner(loaded, ctx, slots=min(slots, blocks), max_seq=s.max_seq_len,
                       max_prefill_tokens=s.max_prefill_tokens, cuda_graphs=s.cuda_graphs,
                       block_size=s.kv_block_size, num_blocks=blocks,
                       kv_int8=s.kv_cache_dtype == "int8", fit=fit,
                       buckets=s.step_buckets, max_step_tokens=s.max_step_tokens)  # fmt: skip


def start(
    cfg: RunConfig,
    ctx: DistContext,
    *,
    slots: int | None = None,
    max_seq: int | None = None,
    runner: ModelRunner | None = None,
) -> Engine | None:
    """Every rank: `prepare` (unless given its runner). Rank 0 returns its Engine (not yet
    running); the other ranks serve rank 0's steps here and return None when it stops."""
    runner = runner or prepare(cfg, ctx, slots=slots, max_seq=max_seq)
    if not ctx.is_rank0:  # rank 0 decides when to stop; its STOP step ends the loop below
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, note_stop_signal)
    s = (runner.loaded.cfg or cfg).server
    if ctx.is_rank0:
        engine = Engine(runner, ctx, load_tokenizer(runner.loaded.model_dir),
                        max_queue=s.max_queue, max_prefill_tokens=s.max_prefill_tokens,
                        prefill_hold_steps=s.prefill_hold_steps,
                        prefix_caching=s.prefix_caching,
                        sampler_rows=s.sampler_rows)  # fmt: skip
        engine.warm_up()
        engine.fit_cache()
        return engine
    settle()  # rank 0's face settles its own heap once its engine is built (serve.py)
    run_worker(runner)
    return None
