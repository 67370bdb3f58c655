"""The `mpinfer` console script: one line per subcommand in `mpinfer --help`, and the small
commands (generate, shard, verify, plan) themselves.

Subcommands that run on every rank (serve, repl, generate) take `--nproc N` to start their
ranks through launcher.py; under torchrun (LOCAL_RANK set) they run as the rank they are. The
tools (make-tiny, bench) live in mpinfer.tools and are named here by module path only, so the
product never imports them. Per-rank mains wrap their work in runtime.run_rank, which tears the
process groups down and ends every rank non-zero on an error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from .checkpoint.hf import read_config
from .checkpoint.hostmem import HostMemoryMonitor, return_large_frees_to_os
from .checkpoint.sharded import shard_checkpoint, verify_dir
from .config import add_config_args, config_from_args, load_config, parse_bytes
from .dist import broadcast_object
from .model.bloom import BloomShape
from .model.memory import COMMON_GPUS, GIB, plan_memory, plan_table, suggest, tp_sizes_for
from .model.offloadplan import check_host_memory, plan_for_throughput, plan_offload, with_offload
from .startup.launcher import Topology, add_launch_args, launch
from .startup.runtime import default_params, load_tokenizer, rank_config, run_rank, start

# name -> ("module:function", one line for `mpinfer --help`)
COMMANDS = {
    "serve": ("mpinfer.server.serve:serve_main", "HTTP server (TGI and OpenAI routes) on rank 0"),
    "repl": ("mpinfer.repl:repl_main", "interactive generation on this terminal"),
    "generate": ("mpinfer.cli:generate_main", "one-shot generation of --prompt texts"),
    "shard": ("mpinfer.cli:shard_main", "quantize and split a checkpoint once, per rank"),
    "verify": ("mpinfer.cli:verify_main", "check a sharded directory's checksums"),
    "plan": ("mpinfer.cli:plan_main", "GPU memory a config needs, per GPU size and tp"),
    "make-tiny": ("mpinfer.tools.tiny:main", "write a random BLOOM checkpoint (tests, demo)"),
    "bench": ("mpinfer.tools.bench:main", "benchmarks: gpu, kernels, load, engine, serve, kv"),
}
RANK_COMMANDS = ("serve", "repl", "generate")
HELP = """usage: mpinfer COMMAND [options]    (mpinfer COMMAND --help for each)

commands:
{commands}

serve, repl and generate run on every rank: --nproc N starts N ranks on this host (or run them
under torchrun --nproc-per-node N launch/serve.py ...). Every one takes --config FILE,
--set section.key=value and --model DIR.

examples:
  mpinfer make-tiny out/tiny && mpinfer generate --nproc 2 --model out/tiny --prompt "Hello"
  mpinfer serve --nproc 2 --config configs/tiny-cpu.toml
  mpinfer plan --config configs/bloom-176b-8x24gb.toml"""


def split_launch_args(argv: list[str]) -> tuple[Topology | None, list[str]]:
    p = argparse.ArgumentParser(add_help=False)
    add_launch_args(p)
    known, rest = p.parse_known_args(argv)
    if known.nproc is None:
        return None, rest
    addr, port = known.master_addr, known.master_port
    if known.rdzv_endpoint:
        addr, _, text = known.rdzv_endpoint.rpartition(":")
        if not addr or not text.isdigit():
            raise ValueError(f"--rdzv-endpoint {known.rdzv_endpoint!r}: expected HOST:PORT")
        port = int(text)
    return Topology(known.nproc, known.nnodes, known.node_rank, addr, port), rest


PARSERS = {"serve": "mpinfer.server.serve:parser", "repl": "mpinfer.repl:parser",
           "generate": "mpinfer.cli:generate_parser"}  # fmt: skip


def check_before_spawning(cmd: str, argv: list[str], topo: Topology) -> None:
    """What can be known before any rank starts, said once (a ValueError): the configuration,
    the model (a Hub id is fetched here, once), the tensor-parallel size against the heads,
    and for `serve` on rank 0's host whether its port can be bound."""
    topo.check()  # --nproc 0 and the like: one line, before anything is read
    module, func = PARSERS[cmd].split(":")
    args = getattr(importlib.import_module(module), func)().parse_args(argv)
    cfg = config_from_args(args)
    shape = BloomShape.from_config(read_config(cfg.model.path))
    world = topo.nproc * topo.nnodes
    if cfg.parallel.tp_size and cfg.parallel.tp_size != world:
        raise ValueError(f"parallel.tp_size={cfg.parallel.tp_size} but {world} ranks were asked "
                         "for (--nproc x --nnodes): they must be equal")  # fmt: skip
    if shape.n_head % world:
        raise ValueError(f"{world} ranks: the model's n_head={shape.n_head} is not divisible by "
                         f"{world}; tensor-parallel sizes that work: "
                         f"{', '.join(map(str, tp_sizes_for(shape, most=64)))}")  # fmt: skip
    if cmd == "serve" and topo.node_rank == 0:
        s = cfg.server
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((s.host, s.port))
            except OSError as e:
                raise ValueError(
                    f"cannot serve on {s.host}:{s.port}: {e.strerror} (another "
                    "server there? --port or server.port picks another)"
                ) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = "\n".join(f"  {n:<{width}}  {line}" for n, (_, line) in COMMANDS.items())
        print(HELP.format(commands=lines), file=sys.stdout if argv else sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in RANK_COMMANDS and "-h" not in rest and "--help" not in rest:
        try:
            topo, rest = split_launch_args(rest)
            if topo is not None and "LOCAL_RANK" not in os.environ:
                check_before_spawning(cmd, rest, topo)
                return launch(topo, cmd, rest)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    target, _ = COMMANDS[cmd]
    module, func = target.split(":")
    try:
        return getattr(importlib.import_module(module), func)(rest)
    except BrokenPipeError:  # `mpinfer plan | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141  # what a shell reports for a writer ended by SIGPIPE


# -- generate ------------------------------------------------------------------------------------
def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpinfer generate",
        description="One-shot generation on all ranks; rank 0 prints the completions.",
        epilog='example: mpinfer generate --nproc 2 --model out/tiny --prompt "Hello" --json',
    )
    add_config_args(p)
    add_launch_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, help="overrides generation.max_new_tokens")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (do_sample=false)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    return p


def generate_main(argv: list[str] | None = None) -> int:
    """Per-rank main of `launch/generate.py` (and of `mpinfer generate`)."""
    args = generate_parser().parse_args(argv)
    cfg = rank_config(args)
    if cfg is None:
        return 2

    def work(ctx):
        prompts = args.prompt or ["The capital of France is"]
        overrides = {"max_new_tokens": args.max_new_tokens}
        if args.greedy:
            overrides["do_sample"] = False
        params = default_params(cfg, **overrides)
        error, ids, slots, max_seq = None, None, 0, 0
        if ctx.is_rank0:
            try:
                params.check()
                tok = load_tokenizer(cfg.model.path)
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
        engine = start(cfg, ctx, slots=slots, max_seq=max_seq)
        if engine is None:
            return None
        results: dict[int, object] = {}
        for i, p in enumerate(ids):
            engine.submit(p, params, lambda ev, i=i: ev.kind != "token" and results.update({i: ev}))
        stopped: list[int] = []

        def on_signal(signum, _frame):  # Ctrl-C: end every request where it is, keep the text
            stopped.append(signum)
            engine.cancel_all()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        engine.run(until_idle=True)
        for i, prompt in enumerate(prompts):
            ev = results[i]
            if ev.kind == "error":
                raise ValueError(f"--prompt {prompt!r}: generation failed: {ev.error}")
            r = ev.result
            if args.json:
                record = {"prompt": prompt, "text": r.text, "prompt_token_ids": r.prompt_token_ids,
                          "token_ids": r.token_ids, "finish_reason": r.finish_reason}  # fmt: skip
                print(json.dumps(record, ensure_ascii=False), flush=True)
            else:
                print(f"{prompt}{r.text}", flush=True)
        if stopped:
            tokens = sum(len(ev.result.token_ids) for ev in results.values() if ev.result)
            print(f"{signal.Signals(stopped[0]).name}: stopped after {tokens} tokens (the text so "
                  "far is above)", file=sys.stderr, flush=True)  # fmt: skip
            return 128 + stopped[0]
        return None

    return run_rank(work, cfg)


# -- shard, verify -------------------------------------------------------------------------------
def parse_ranks(text: str) -> list[int]:
    """'0-3' or '4,5' or '2' -> rank numbers."""
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"--ranks {text!r}: expected e.g. 0-3 or 4,5,6,7") from None
    return out


def shard_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer shard", description="Quantize an HF checkpoint "
                                "and cut it into one safetensors file per tensor-parallel rank, "
                                "plus a manifest, in one pass with bounded host RAM; a rerun "
                                "resumes where an interrupted one stopped.",
                                epilog="example: mpinfer shard --model /data/bloom --tp 8 "
                                "--out /data/bloom-int8-tp8")  # fmt: skip
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quant", default="int8", choices=("int8", "int4", "llm.int8", "none"))
    p.add_argument("--embeddings", default="none", choices=("none", "int8"))
    p.add_argument("--group-size", type=int, default=128,
                   help="int4: inputs per group (one fp16 scale and offset each)")  # fmt: skip
    p.add_argument("--symmetric", action="store_true",
                   help="int4: symmetric groups (no offset of their own)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="dtype of unquantized tensors (auto: as stored)")
    p.add_argument("--ranks", help="write only these ranks' files, e.g. 0-3 (one host's part)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    return_large_frees_to_os()
    t0 = time.perf_counter()
    try:
        ranks = parse_ranks(a.ranks) if a.ranks else None
        with HostMemoryMonitor() as mem:
            m = shard_checkpoint(a.model, a.out, tp_size=a.tp, quant=a.quant,
                                 embeddings=a.embeddings, group_size=a.group_size,
                                 symmetric=a.symmetric, dtype=a.dtype, ranks=ranks)  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(f["bytes"] for f in m["files"])
    print(
        f"wrote {len(m['files'])} rank files ({total / 1e9:.2f} GB) to {a.out} in "
        f"{time.perf_counter() - t0:.1f} s; peak anonymous host RAM {mem.peak_mib:.0f} MiB "
        f"(+{mem.peak_mib - mem.start_mib:.0f} over start)"
    )
    return 0


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpinfer verify", description="check every checksum of DIR",
                                epilog="example: mpinfer verify /data/bloom-int8-tp8")  # fmt: skip
    p.add_argument("dir")
    a = p.parse_args(argv)
    try:
        problems = verify_dir(Path(a.dir))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"BAD {line}")
    return 1 if problems else 0


# -- plan ----------------------------------------------------------------------------------------
def plan_main(argv: list[str]) -> int:
    """`mpinfer plan`: per-GPU memory of a config, from config.json alone. Without --gpu-mem
    (and no model.memory_budget), a table for common GPU sizes and every tp size that divides
    the heads; with it, the detailed list for one GPU and tp size."""
    p = argparse.ArgumentParser(prog="mpinfer plan", description=plan_main.__doc__,
                                epilog="examples:\n  mpinfer plan --config configs/bloom-7b1.toml"
                                "\n  mpinfer plan --model /data/bloom --gpu-mem 24GiB --tp 8",
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: parallel.tp_size)")
    p.add_argument("--arch", help="the model's config.json (default: model.path's, or model.arch)")
    p.add_argument("--host-gbps", type=float, default=25.0,
                   help="host-to-GPU copy speed for the offload estimate (default 25: PCIe 4 "
                   "x16; an H200 measured 55)")  # fmt: skip
    p.add_argument("--host-mem", metavar="SIZE",
                   help="host RAM free for the offloaded blocks of all tp ranks (default: what "
                   "this machine has available)")  # fmt: skip
    p.add_argument("--gpu-tbps", type=float, default=0.9,
                   help="GPU memory speed for the offload estimate (default 0.9: a 24 GB RTX "
                   "3090/4090)")  # fmt: skip
    p.add_argument("--gpu-tflops", type=float, default=80.0,
                   help="GPU fp16 matmul rate for the offload estimate (default 80: an RTX "
                   "4090 with fp32 accumulation)")  # fmt: skip
    p.add_argument(
        "--request",
        default="512+256",
        metavar="PROMPT+OUTPUT",
        help="the request shape to count sequences at once for (default 512+256)",
    )
    a = p.parse_args(argv)
    try:
        request = parse_request_shape(a.request)
        overrides = list(a.overrides)
        for flag, key in ((a.model, "model.path"), (a.quant, "quant.method"),
                          (a.dtype, "model.dtype")):  # fmt: skip
            if flag:
                overrides.append(f'{key}="{flag}"')
        cfg = load_config(a.config, overrides)
        arch = Path(a.arch) if a.arch else Path(cfg.model.path) / "config.json"
        if not arch.is_file() and cfg.model.arch:
            arch = Path(cfg.model.arch)
        if not arch.is_file():
            raise ValueError("no config.json: pass --arch FILE, --model DIR or set model.arch")
        shape = BloomShape.from_config(json.loads(arch.read_text()))
        tp = a.tp or cfg.parallel.tp_size or None
        if tp:
            shape.check_tp(tp)
        text = a.gpu_mem or cfg.model.memory_budget
        budget = parse_bytes(text, "--gpu-mem") if text else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quant = cfg.quant.method + (" + int8 embeddings" if cfg.quant.embeddings == "int8" else "")
    print(
        f"{arch.name}: {shape.n_layer} layers, hidden {shape.hidden_size}, {shape.n_head} "
        f"heads; quant={quant}, dtype={cfg.model.dtype}, max_seq_len={cfg.server.max_seq_len}"
    )
    if budget is None:
        return print_plan_table(shape, cfg, tp, request)
    tp = tp or 1
    try:
        # Every rank of the group on one host, each pinning its own share of the blocks.
        have = parse_bytes(a.host_mem, "--host-mem") if a.host_mem else None
        asked = cfg
        cfg, fast = plan_for_throughput(
            shape, cfg, tp_size=tp, budget=budget,
            host_bytes=have // tp if have is not None else None,
            host_gbps=a.host_gbps, gpu_tbps=a.gpu_tbps, gpu_tflops=a.gpu_tflops)  # fmt: skip
        off = plan_offload(shape, cfg, tp_size=tp, budget=budget)
        check_host_memory(off, ranks=tp, available=have)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    whole = plan_memory(shape, asked, tp_size=tp, budget=budget)
    plan = with_offload(plan_memory(shape, cfg, tp_size=tp, budget=budget), off)
    print(f"tp={tp}")
    print("\n".join(plan.lines(request)))
    if off is not None:
        print("\n".join(off.lines(shape.n_layer, a.host_gbps, a.gpu_tbps, a.gpu_tflops)))
    if fast is not None:
        s = cfg.server
        print("\n".join(fast.lines(a.host_gbps)))
        print(f"(what start-up sets: model.offload_blocks={fast.blocks}, server.kv_cache_dtype="
              f"{s.kv_cache_dtype!r}, quant.embeddings={cfg.quant.embeddings!r}, "
              f"max_batch_slots={s.max_batch_slots}, max_prefill_tokens="
              f"{s.max_prefill_tokens}; a step costs its copies at any batch until compute "
              "outlasts them: the budget buys KV room and rows, not resident blocks)")  # fmt: skip
        if not whole.fits:  # say what keeps every block on the GPU instead
            print(
                f"every block on the GPU would need {whole.one_slot / GIB:.2f} GiB per GPU, "
                f"has {budget / GIB:.2f}: {suggest(shape, cfg, tp_size=tp, budget=budget)}"
            )
    if not plan.fits:
        print(f"does not fit: needs {plan.one_slot / GIB:.2f} GiB per GPU, has {budget / GIB:.2f}; "
              f"{suggest(shape, cfg, tp_size=tp, budget=budget)}")  # fmt: skip
        return 1
    return 0


def parse_request_shape(text: str) -> tuple[int, int]:
    """'512+256' -> (512, 256)."""
    prompt, plus, output = text.partition("+")
    if not (plus and prompt.strip().isdigit() and output.strip().isdigit()):
        raise ValueError(f"--request={text!r}: expected PROMPT+OUTPUT tokens, e.g. 512+256")
    return int(prompt), int(output)


def print_plan_table(shape: BloomShape, cfg, tp: int | None, request=(512, 256)) -> int:
    budgets = [(g, parse_bytes(g, "gpu")) for g in COMMON_GPUS]
    rows = plan_table(shape, cfg, budgets=budgets, tp_sizes=[tp] if tp else tp_sizes_for(shape),
                      request=request)  # fmt: skip
    shape_col = f"{request[0]}+{request[1]}"
    print(f"{'GPU':>6} {'tp':>3}  {'fits':<4} {'weights/GPU':>12} {'total/GPU':>10} "
          f"{'KV tokens':>10} {shape_col:>9} {'max_seq':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['gpu']:>6} {r['tp']:>3}  {'yes' if r['fits'] else 'no':<4} "
              f"{r['weights'] / GIB:>8.2f} GiB {r['total'] / GIB:>6.2f} GiB "
              f"{r['kv_tokens']:>10} {r['sequences']:>9} {r['slots']:>7}")  # fmt: skip
    print(
        f"(sequences at once of {shape_col} tokens and of max_seq_len="
        f"{cfg.server.max_seq_len}, at most server.max_batch_slots={cfg.server.max_batch_slots};"
        " --gpu-mem SIZE [--tp N] for one GPU's details)"
    )
    return 0 if any(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
