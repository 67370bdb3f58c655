"""The `mpinfer` console script and the per-rank entry points behind `launch/*.py`.

Subcommands: `make-tiny` (a random HF-format BLOOM), `generate` (one-shot generation; with
`--nproc N` it starts the N ranks itself through torch's launcher), `shard` and `verify`
(pre-sharded checkpoints). Per-rank mains wrap their work in try/finally so that process groups
are destroyed and every rank exits non-zero on an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .config import add_config_args, config_from_args
from .dist import broadcast_object

log = logging.getLogger("mpinfer")


def load_tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: mpinfer needs the model's fast tokenizer file")
    return Tokenizer.from_file(str(path))


def sampling_params(cfg, *, max_new_tokens: int | None = None, greedy: bool = False):
    """The config's [generation] defaults as SamplingParams (with CLI overrides)."""
    from .generation import SamplingParams

    g = cfg.generation
    return SamplingParams(
        max_new_tokens=max_new_tokens or g.max_new_tokens,
        do_sample=g.do_sample and not greedy,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        repetition_penalty=g.repetition_penalty,
        seed=g.seed,
    )


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpinfer generate",
        description="One-shot generation on all ranks; rank 0 prints the completions.",
    )
    add_config_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, help="overrides generation.max_new_tokens")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (do_sample=false)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    return p


def run_rank(work, cfg) -> int:
    """Init the process groups, run `work(ctx)`, tear down; user errors exit 1 on every rank."""
    from .dist import init_distributed, teardown

    ctx = init_distributed(timeout_s=cfg.parallel.timeout_s)
    try:
        work(ctx)
        return 0
    except ValueError as e:
        log.error("%s", e)
        return 1
    finally:
        teardown()


def generate_main(argv: list[str] | None = None) -> int:
    """Per-rank main of `launch/generate.py` (and of `mpinfer generate`)."""
    args = _generate_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def work(ctx):
        from .engine import Engine, worker_loop
        from .loader import load_model

        loaded = load_model(cfg, ctx)
        prompts = args.prompt or ["The capital of France is"]
        params = sampling_params(cfg, max_new_tokens=args.max_new_tokens, greedy=args.greedy)
        error, tok, ids, slots, max_seq = None, None, None, 0, 0
        if ctx.is_rank0:
            try:
                params.check()
                tok = load_tokenizer(loaded.model_dir)
                ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
                if not all(ids):
                    raise ValueError("--prompt: a prompt is empty (no tokens)")
                slots = min(cfg.server.max_batch_slots, len(ids))
                max_seq = max(len(i) for i in ids) + params.max_new_tokens
            except ValueError as e:
                error = str(e)
        error, slots, max_seq = broadcast_object((error, slots, max_seq), ctx)
        if error:
            raise ValueError(error)
        if not ctx.is_rank0:
            worker_loop(loaded, ctx, slots, max_seq)
            return
        engine = Engine(loaded, ctx, tok, slots=slots, max_seq=max_seq)
        results: dict[int, object] = {}
        for i, p in enumerate(ids):
            engine.submit(p, params, lambda ev, i=i: ev.kind == "done" and results.update({i: ev}))
        engine.run(until_idle=True)
        for i, prompt in enumerate(prompts):
            r = results[i].result
            if args.json:
                record = {
                    "prompt": prompt,
                    "text": r.text,
                    "prompt_token_ids": r.prompt_token_ids,
                    "token_ids": r.token_ids,
                    "finish_reason": r.finish_reason,
                }
                print(json.dumps(record, ensure_ascii=False), flush=True)
            else:
                print(f"{prompt}{r.text}", flush=True)

    return run_rank(work, cfg)


def _launch_ranks(nproc: int, subcommand: str, rest: list[str]) -> int:
    """Start `nproc` ranks of `python -m mpinfer.cli SUBCOMMAND ...` through torch's launcher."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if nproc < 1:
        print(f"error: --nproc={nproc} must be >= 1", file=sys.stderr)
        return 2
    launcher_args = ["--standalone", "--nproc-per-node", str(nproc), "-m", "mpinfer.cli"]
    try:
        torchrun.main(launcher_args + [subcommand, *rest])
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        return max(codes) if codes and max(codes) > 0 else 1
    return 0


def _make_tiny_main(argv: list[str]) -> int:
    from .tiny import make_tiny

    p = argparse.ArgumentParser(prog="mpinfer make-tiny", description=make_tiny.__doc__)
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--format", choices=("safetensors", "bin"), default="safetensors")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix", action="store_true", help="keys without 'transformer.'")
    a = p.parse_args(argv)
    try:
        out = make_tiny(
            a.out,
            layers=a.layers,
            hidden=a.hidden,
            heads=a.heads,
            vocab=a.vocab,
            shards=a.shards,
            fmt=a.format,
            seed=a.seed,
            dtype=a.dtype,
            prefix=not a.no_prefix,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _pop_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    rest, nproc, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc" and i + 1 < len(argv):
            nproc, i = int(argv[i + 1]), i + 2
            continue
        if arg.startswith("--nproc="):
            nproc = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return nproc, rest


def _serve_main(argv: list[str]) -> int:
    from .serving import serve_main

    return serve_main(argv)


def _repl_main(argv: list[str]) -> int:
    from .repl import repl_main

    return repl_main(argv)


# Subcommands that run on every rank (and take --nproc to start the ranks themselves).
RANK_MAINS = {"generate": generate_main, "serve": _serve_main, "repl": _repl_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"make-tiny": _make_tiny_main, **{k: None for k in RANK_MAINS}}
    commands.update(_extra_commands())
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        names = ", ".join(commands)
        print(f"usage: mpinfer {{{names}}} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in RANK_MAINS:
        nproc, rest = _pop_nproc(rest)
        if nproc is not None and "LOCAL_RANK" not in os.environ:
            return _launch_ranks(nproc, cmd, rest)
        return RANK_MAINS[cmd](rest)
    return commands[cmd](rest)


def _extra_commands() -> dict:
    """Subcommands defined in other modules (kept there, next to what they drive)."""
    from . import sharded

    def bench(argv):
        from .bench import bench_main

        return bench_main(argv)

    from .memory import plan_main

    return {"shard": sharded.shard_main, "verify": sharded.verify_main, "bench": bench,
            "plan": plan_main}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
