"""Memory: host RAM measured during loading, and the GPU memory planner.

`HostMemoryMonitor` samples this process's anonymous resident memory (RssAnon: heap and
anonymous mappings, not the page cache of mmap-ed checkpoint files, which the kernel can drop
at will) on a background thread, so a load can report its true peak.

`plan_memory` counts, per rank, what the TP plan puts on each GPU (int8 weights, scales,
embeddings, biases and norms), a CUDA context reserve and an activation workspace, and how many
KV-cache tokens fit in what is left; `mpinfer plan` prints it and start-up uses it to refuse a
model that cannot fit, before loading anything. `memory_check` serves a config on a GPU and
compares the planner's total with what the driver reports (`mpinfer bench gpu --memory`).
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import threading
import time
from dataclasses import dataclass
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
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    # Not glibc (musl, macOS): there is no such knob, and nothing to pin.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).mallopt(-3, threshold)


# -- the GPU memory planner ----------------------------------------------------------------------
GIB = 2**30
# What the CUDA context, cuBLAS/NCCL workspaces and the allocator's slack take per GPU before a
# single weight is placed (a conservative figure: 0.5-0.9 GiB measured across recent drivers).
CONTEXT_RESERVE = int(0.75 * GIB)


@dataclass(frozen=True)
class MemoryPlan:
    tp_size: int
    items: dict  # name -> bytes per rank
    kv_bytes_per_token: int
    budget: int
    max_seq_len: int

    @property
    def fixed(self) -> int:
        return sum(self.items.values())

    @property
    def kv_tokens(self) -> int:
        return max(0, (self.budget - self.fixed) // self.kv_bytes_per_token)

    @property
    def slots(self) -> int:
        return self.kv_tokens // self.max_seq_len

    @property
    def fits(self) -> bool:
        return self.slots >= 1

    @property
    def one_slot(self) -> int:
        """Bytes per GPU for the weights, the workspace and one max_seq_len KV slot."""
        return self.fixed + self.kv_bytes_per_token * self.max_seq_len

    def lines(self) -> list[str]:
        out = [f"{name:<28}{nbytes / GIB:8.2f} GiB" for name, nbytes in self.items.items()]
        out += [
            f"{'total before KV cache':<28}{self.fixed / GIB:8.2f} GiB",
            f"{'budget per GPU':<28}{self.budget / GIB:8.2f} GiB",
            f"{'KV cache per token':<28}{self.kv_bytes_per_token / 2**20:8.3f} MiB",
            f"{'KV cache tokens that fit':<28}{self.kv_tokens:8d}",
            f"{'slots of max_seq_len=' + str(self.max_seq_len):<28}{self.slots:8d}",
        ]
        return out


def plan_memory(shape, cfg, *, tp_size: int, budget: int) -> MemoryPlan:
    """Per-rank device bytes of the model `cfg` describes, from the TP plan itself."""
    from .plan import plan_model

    dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
    quant = cfg.quant.method != "none"
    plans = plan_model(shape, tp_size, quantize=quant,
                       quantize_embeddings=cfg.quant.embeddings == "int8")  # fmt: skip
    items = {"weights (int8)": 0, "scales": 0, "embeddings and LM head": 0,
             "biases and norms": 0}  # fmt: skip
    largest = 0
    dense_key = f"weights ({cfg.model.dtype})"
    for p in plans:
        rank_shape = p.rank_shape(tp_size)
        n, rows = math.prod(rank_shape), rank_shape[0]
        if p.name.startswith("word_embeddings."):
            items["embeddings and LM head"] += n * (1 if p.quantize else dtype_bytes)
            items["scales"] += rows * 4 if p.quantize else 0
        elif p.quantize:
            items["weights (int8)"] += n
            items["scales"] += rows * 4
            largest = max(largest, n)
        elif len(p.shape) == 2:  # quant = none: the block weights in the compute dtype
            items[dense_key] = items.get(dense_key, 0) + n * dtype_bytes
        else:
            items["biases and norms"] += n * dtype_bytes
    if not quant:
        del items["weights (int8)"], items["scales"]
    h, v = shape.hidden_size, shape.vocab_size
    s = cfg.server
    workspace = (
        largest * dtype_bytes  # the dequantized weight of a prefill matmul
        + s.max_prefill_tokens * 8 * h // tp_size * dtype_bytes * 2  # prefill activations
        + s.max_batch_slots * v * 4 * 2  # gathered fp32 logits and their softmax
    )
    items["CUDA context reserve"] = CONTEXT_RESERVE
    items["activation workspace"] = workspace
    kv = 2 * shape.n_layer * (h // tp_size) * dtype_bytes
    return MemoryPlan(tp_size, items, kv, budget, s.max_seq_len)


def suggest(shape, cfg, *, tp_size: int, budget: int) -> str:
    """A way out when the model does not fit: a larger tp size, or int8."""
    for tp in range(tp_size + 1, 65):
        if shape.n_head % tp == 0 and plan_memory(shape, cfg, tp_size=tp, budget=budget).fits:
            return f"try tp={tp}"
    if cfg.quant.method == "none":
        return "try quant.method=int8"
    return "use GPUs with more memory"


def budget_bytes(cfg, device) -> int | None:
    """The per-rank device budget: model.memory_budget, else the GPU's memory (None on CPU)."""
    from .config import parse_bytes

    if cfg.model.memory_budget:
        return parse_bytes(cfg.model.memory_budget, "model.memory_budget")
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_fits(shape, cfg, *, tp_size: int, device) -> MemoryPlan | None:
    """Refuse, before anything is loaded, a model whose weights leave no room for one slot."""
    budget = budget_bytes(cfg, device)
    if budget is None:
        return None
    plan = plan_memory(shape, cfg, tp_size=tp_size, budget=budget)
    if not plan.fits:
        raise ValueError(
            f"does not fit: needs {plan.one_slot / GIB:.2f} GiB per GPU (weights and workspace "
            f"{plan.fixed / GIB:.2f} GiB + one {plan.max_seq_len}-token KV slot), has "
            f"{budget / GIB:.2f} GiB; {suggest(shape, cfg, tp_size=tp_size, budget=budget)}"
        )
    return plan


def kv_slots(loaded, cfg, ctx) -> int:
    """KV-cache slots for the engine: the config's, fewer if the memory actually free after
    loading holds fewer (every rank agrees on the smallest); an error if not even one fits."""
    from .dist import broadcast_object, gather_objects

    want, s = cfg.server.max_batch_slots, cfg.server
    fit = want
    if loaded.device.type == "cuda":
        import torch

        free = torch.cuda.mem_get_info(loaded.device)[0]
        budget = budget_bytes(cfg, loaded.device)
        used = torch.cuda.memory_allocated(loaded.device)
        free = min(free, budget - used - CONTEXT_RESERVE)
        plan = plan_memory(loaded.shape, cfg, tp_size=loaded.tp.tp_size, budget=budget)
        per_slot = plan.kv_bytes_per_token * s.max_seq_len
        fit = max(0, free - plan.items["activation workspace"]) // per_slot
    fits = gather_objects(fit, ctx)
    fit = broadcast_object(min(fits) if ctx.is_rank0 else None, ctx)
    if fit < 1:
        raise ValueError(f"no room for a KV cache of max_seq_len={s.max_seq_len} tokens after "
                         "loading: lower server.max_seq_len or raise tp")  # fmt: skip
    if fit < want and ctx.is_rank0:
        import logging

        logging.getLogger("mpinfer").warning(
            "server.max_batch_slots=%d does not fit beside the weights: using %d", want, fit
        )
    return min(want, fit)


# -- the planner against a GPU (a benchmark: `mpinfer bench gpu --memory`) ----------------------
# label, bench shape, row kind (bench.build_random), config file, tp size
MEMORY_CASES = [
    ("bloom-7b1 int8", "bloom-7b1", "int8", "configs/bloom-7b1.toml", 1),
    ("bloom-7b1 fp16", "bloom-7b1", "none", "configs/bloom-7b1.toml", 1),
    ("bloom-176b tp-8 rank", "bloom-176b", "int8:emb8", "configs/bloom-176b-8x24gb.toml", 8),
]


def memory_check(label, shape_name, kind, config_path, tp_size) -> dict:
    """The planner's per-GPU total for a config against what the GPU holds at the peak of
    serving it: the weights, a KV cache of the config's slots x max_seq_len, a prefill of
    max_prefill_tokens and a decode step over every slot with fp32 logits and their softmax
    (what the engine does). Measured = the allocator's peak reservation + what lives outside
    it (CUDA context, cuBLAS and Triton modules), read from the driver."""
    import torch

    from .bench import SHAPES, build_random, free_gpu
    from .config import load_config
    from .model import KVCache
    from .plan import BloomShape

    method, _, emb = kind.partition(":")
    cfg = load_config(config_path, [f'quant.method="{method}"',
                                    f'quant.embeddings="{"int8" if emb else "none"}"'])  # fmt: skip
    dev = torch.device("cuda")
    free_gpu()
    plan = plan_memory(BloomShape(**SHAPES[shape_name]), cfg, tp_size=tp_size,
                       budget=budget_bytes(cfg, dev))  # fmt: skip
    s = cfg.server
    slots = max(1, min(s.max_batch_slots, plan.slots))
    model, shape, _ = build_random(shape_name, kind, tp_size=tp_size)
    free_gpu()  # the random fill's temporaries are not serving memory (the loader has none)
    cache = KVCache.allocate(shape, tp_size, slots=slots, max_seq=s.max_seq_len,
                             dtype=model.dtype, device=dev)  # fmt: skip
    T = min(s.max_prefill_tokens, s.max_seq_len - 1)
    one = torch.zeros(1, dtype=torch.long, device=dev)
    ids = torch.randint(4, shape.vocab_size, (1, T), device=dev)
    model(ids, cache, slots=one, start_pos=one, valid_from=one, kv_len=T).float().softmax(-1)
    pos = torch.full((slots,), T, dtype=torch.long, device=dev)
    tokens = torch.randint(4, shape.vocab_size, (slots, 1), device=dev)
    logits = model(tokens, cache, slots=torch.arange(slots, device=dev), start_pos=pos,
                   valid_from=torch.zeros_like(pos), kv_len=T + 1)  # fmt: skip
    logits.float().softmax(-1)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    measured = torch.cuda.max_memory_reserved() + outside
    predicted = plan.fixed + slots * s.max_seq_len * plan.kv_bytes_per_token
    peak_allocated = torch.cuda.max_memory_allocated()
    del model, cache, logits
    free_gpu()
    return {
        "case": label, "config": config_path, "quant": kind, "tp_size": tp_size,
        "slots": slots, "max_seq_len": s.max_seq_len, "prefill_tokens": T,
        "planned": {k: v / GIB for k, v in plan.items.items()},
        "predicted_GiB": predicted / GIB, "measured_GiB": measured / GIB,
        "peak_allocated_GiB": peak_allocated / GIB, "outside_allocator_GiB": outside / GIB,
        "error_pct": 100 * (predicted - measured) / measured,
    }  # fmt: skip


def memory_check_table(checks: list[dict]) -> str:
    from .bench import md_table

    header = ["planner vs GPU", "slots x max_seq_len", "prefill", "predicted GiB", "measured GiB",
              "error", "of which outside torch's allocator"]  # fmt: skip
    return md_table(header, [
        [m["case"], f"{m['slots']} x {m['max_seq_len']}", m["prefill_tokens"],
         f"{m['predicted_GiB']:.2f}", f"{m['measured_GiB']:.2f}", f"{m['error_pct']:+.1f} %",
         f"{m['outside_allocator_GiB']:.2f} GiB"]
        for m in checks
    ])  # fmt: skip


def plan_main(argv: list[str]) -> int:
    """`mpinfer plan`: per-GPU memory of a config, from config.json alone."""
    import argparse
    import json

    from .config import add_config_args, load_config, parse_bytes
    from .plan import BloomShape

    p = argparse.ArgumentParser(prog="mpinfer plan", description=plan_main.__doc__)
    add_config_args(p)
    p.add_argument("--gpu-mem", help="memory per GPU, e.g. 24GiB (default: model.memory_budget)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: parallel.tp_size)")
    p.add_argument("--arch", help="the model's config.json (default: model.path's, or model.arch)")
    a = p.parse_args(argv)
    try:
        overrides = list(a.overrides)
        for flag, key in ((a.model, "model.path"), (a.quant, "quant.method"),
                          (a.dtype, "model.dtype")):  # fmt: skip
            if flag:
                overrides.append(f'{key}="{flag}"')
        cfg = load_config(a.config, overrides)
        arch = a.arch or (Path(cfg.model.path) / "config.json")
        if not Path(arch).is_file():
            arch = cfg.model.arch
        if not arch or not Path(arch).is_file():
            raise ValueError("no config.json: pass --arch FILE, --model DIR or set model.arch")
        shape = BloomShape.from_config(json.loads(Path(arch).read_text()))
        tp = a.tp or cfg.parallel.tp_size or 1
        shape.check_tp(tp)
        text = a.gpu_mem or cfg.model.memory_budget
        if not text:
            raise ValueError("how much memory per GPU? pass --gpu-mem (e.g. 24GiB)")
        budget = parse_bytes(text, "--gpu-mem")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan = plan_memory(shape, cfg, tp_size=tp, budget=budget)
    quant = cfg.quant.method + (" + int8 embeddings" if cfg.quant.embeddings == "int8" else "")
    print(f"{Path(arch).name}: {shape.n_layer} layers, hidden {shape.hidden_size}, "
          f"{shape.n_head} heads; tp={tp}, quant={quant}, dtype={cfg.model.dtype}")  # fmt: skip
    print("\n".join(plan.lines()))
    if not plan.fits:
        print(f"does not fit: needs {plan.one_slot / GIB:.2f} GiB per GPU, has {budget / GIB:.2f}; "
              f"{suggest(shape, cfg, tp_size=tp, budget=budget)}")  # fmt: skip
        return 1
    return 0
