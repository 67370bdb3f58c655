"""Run configuration: frozen dataclasses read from TOML, with `--set section.key=value` overrides.

What is here: the sections of the config (model, quant, parallel, generation, server; the
README's table lists every key), strict parsing (an unknown key or a value of the wrong type is
a `ValueError` naming the key), and the shared command-line options every entry point takes.
What is not: the model's own architecture (the checkpoint's config.json: `model.BloomShape`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .extras import require

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANT_METHODS = ("int8", "int4", "llm.int8", "none")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    # "auto": bfloat16 on CUDA, float32 on CPU.
    dtype: str = "auto"
    # Sharded checkpoints: check each rank file's sha256 against the manifest before loading.
    verify: bool = True
    # The model's config.json for `mpinfer plan` when model.path has none (no checkpoint here).
    arch: str = ""
    # GPU memory per rank, e.g. "22GiB"; "" = all of it: the process's whole footprint as
    # nvidia-smi shows it (context, graphs, workspaces, NCCL). Checked before loading (a model
    # that does not fit is refused with the numbers); the KV cache gets what the process does
    # not hold after warm-up, less memory_margin.
    memory_budget: str = ""
    # What the KV cache leaves under the budget for allocator fragmentation and what warm-up
    # does not allocate (docs/performance.md has the served peaks it was chosen from).
    memory_margin: str = "256MiB"
    # With a Hub model id as path: the branch, tag or commit to use ("" = main).
    revision: str = ""
    # Blocks whose weights stay in host memory, copied in as each runs (model/offload.py): -1 =
    # as many as the budget needs (none when the model fits); 0 = none (a model over the budget
    # is refused); N = N.
    offload_blocks: int = -1
    # Offloaded blocks on the GPU at once (copies in flight ahead of the compute).
    offload_depth: int = 2


@dataclass(frozen=True)
class QuantConfig:
    method: str = "int8"
    # LLM.int8() outlier threshold (bitsandbytes); ignored by the other methods.
    threshold: float = 6.0
    # "none": embeddings and the tied LM head stay in the compute dtype; "int8": quantized too;
    # "auto": "none", unless the model is over its memory budget and the throughput plan
    # (offloadplan.py) finds that int8 ones buy more rows a step (it says so at start-up).
    embeddings: str = "auto"
    # int4: inputs per group (one scale and offset each); a power of two, 32 to 512, that
    # divides every matrix's input features per rank.
    group_size: int = 128
    # int4: scale = absmax / 7 around zero instead of each group's own min and range.
    symmetric: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    # 0 means "the world size"; any other value must equal it.
    tp_size: int = 0
    # Seconds a collective may wait before the process group gives up (no rank hangs forever).
    timeout_s: float = 600.0


@dataclass(frozen=True)
class GenerationConfig:
    """Defaults of every face (HTTP routes, REPL, generate) where a request does not say."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    # -1: every request draws its own seed (and reports it); >= 0: this seed.
    seed: int = -1


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # A bearer token on every route but /health: the key, or "env:NAME" (an environment
    # variable) or "file:PATH" (a file's first line), so it need not show in `ps`.
    api_key: str = ""
    # Sequences in the KV cache at once (cache rows), a cap: how many actually run is decided
    # by the cache's free blocks (engine.py).
    max_batch_slots: int = 32
    max_seq_len: int = 2048
    # The KV cache in blocks of this many tokens (blocks.py); max_seq_len gives the old static
    # layout (one block per sequence).
    kv_block_size: int = 16
    # Tokens of KV cache: 0 = all the GPU memory left after the weights and workspace (on a CPU,
    # max_batch_slots x max_seq_len); otherwise at most this many.
    kv_cache_tokens: int = 0
    # Reuse the cached blocks of a prompt's prefix that an earlier request computed.
    prefix_caching: bool = True
    # The prefix cache's hit counters on /metrics: a client that can read them (and send
    # requests) can tell whether another client sent a prompt it guesses; false hides them
    # (clients can also isolate themselves with vLLM's cache_salt)
    prefix_cache_metrics: bool = True
    # "auto": keys and values in the model's dtype, int8 when blocks are in host memory; "model":
    # the model's dtype always; "int8": int8 with a scale per token and head (about half the
    # memory: twice the tokens; docs/performance.md has its accuracy).
    kv_cache_dtype: str = "auto"
    max_queue: int = 128
    # Seconds to finish in-flight requests after SIGTERM/SIGINT before cancelling them; keep it
    # under torchrun's own 30 s grace period.
    shutdown_timeout: float = 20.0
    max_body_bytes: int = 1 << 20
    # What one client may hold (guard.py): request line and headers, open connections, and how
    # long a connection may stay open with no request in progress (its first one included).
    max_header_bytes: int = 64 << 10
    max_connections: int = 512
    idle_timeout_s: float = 10.0
    request_timeout_s: float = 30.0  # a request's body must have arrived by then
    max_stream_backlog: int = 4096  # events waiting for a client that does not read its stream
    # What one request may ask the sampler and the answer to carry (its cost to everyone else)
    max_logit_bias: int = 1024  # logit_bias entries
    max_token_ids: int = 4096  # allowed_token_ids, stop_token_ids
    max_logprob_entries: int = 262144  # log-probabilities (chosen + alternatives) in one answer
    # Extra Host header names accepted when bound to loopback (comma-separated; "*": any).
    allowed_hosts: str = ""
    # Engine jobs one request may ask for (prompts x n x best_of).
    max_jobs_per_request: int = 64
    # /health answers 503 when no engine step completed for this long while work was pending.
    stall_timeout_s: float = 30.0
    # Prompt tokens per engine step (they run in the same forward as the step's decode rows),
    # so a long prompt does not stall running decodes: docs/performance.md has the sweep.
    max_prefill_tokens: int = 512
    # A step's tokens, decode rows and prompt together (0: no cap; model/steps.py says why).
    max_step_tokens: int = 512
    # Steps a prompt may wait while decodes run, for more prompt tokens to join its step (fewer,
    # fuller mixed steps): 0 never waits. On the H200 mix, 4 with a 256 budget cut the
    # inter-token p99 (27 -> 22 ms) but cost TTFT and throughput (docs/performance.md).
    prefill_hold_steps: int = 0
    # Serve /docs and /redoc (Swagger UI and ReDoc, whose scripts come from a CDN).
    docs: bool = False
    # Rows of logits the sampler takes a pass (0: 66 of BLOOM's 250,880-token vocabulary, 16 with
    # blocks in host memory): a pass's temporaries are about 64 bytes a logit (16 rows: 245 MiB
    # that the KV cache does not get), and each pass costs the host about 0.7 ms of launches,
    # hidden behind the GPU's step when that is long (a large model on small cards).
    sampler_rows: int = 0
    # Capture the decode step in CUDA graphs (one per batch-size bucket) on GPUs.
    cuda_graphs: bool = True
    # The step graphs' token counts: "auto" (powers of two up to a full step) or a list such as
    # "1,8,64,512" (fewer graphs, less memory; a step runs the smallest bucket that holds it).
    step_buckets: str = "auto"
    # A Jinja chat template file for /v1/chat/completions; "" = the tokenizer's, else BLOOM's
    # default (chat.py).
    chat_template: str = ""


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> RunConfig:
        if self.model.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.model.dtype!r}: expected one of {DTYPES}")
        if self.model.memory_budget:
            parse_bytes(self.model.memory_budget, "model.memory_budget")
        parse_bytes(self.model.memory_margin, "model.memory_margin")
        if self.model.offload_blocks < -1:
            raise ValueError(f"model.offload_blocks={self.model.offload_blocks} must be >= -1 "
                             "(-1: as many as the budget needs)")  # fmt: skip
        if self.model.offload_depth < 1:
            raise ValueError(f"model.offload_depth={self.model.offload_depth} must be >= 1")
        if self.model.offload_blocks > 0 and self.quant.method == "llm.int8":
            raise ValueError("model.offload_blocks: bitsandbytes layers (quant.method=llm.int8) "
                             "cannot be offloaded; use int8 or none")  # fmt: skip
        if self.quant.method not in QUANT_METHODS:
            raise ValueError(f"quant.method={self.quant.method!r}: expected one of {QUANT_METHODS}")
        if self.quant.embeddings not in ("auto", "none", "int8"):
            raise ValueError(
                f"quant.embeddings={self.quant.embeddings!r}: expected 'auto', 'none' or 'int8'"
            )
        gs = self.quant.group_size
        if not (32 <= gs <= 512 and gs & (gs - 1) == 0):
            raise ValueError(f"quant.group_size={gs} must be a power of two from 32 to 512")
        if self.quant.threshold < 0:
            raise ValueError(f"quant.threshold={self.quant.threshold} must be >= 0")
        if self.parallel.tp_size < 0:
            raise ValueError(f"parallel.tp_size={self.parallel.tp_size} must be >= 0")
        if self.parallel.timeout_s <= 0:
            raise ValueError(f"parallel.timeout_s={self.parallel.timeout_s} must be > 0")
        g = self.generation
        if g.max_new_tokens <= 0:
            raise ValueError(f"generation.max_new_tokens={g.max_new_tokens} must be > 0")
        if not (g.temperature >= 0 and math.isfinite(g.temperature)):
            raise ValueError(f"generation.temperature={g.temperature} must be a finite number >= 0")
        if g.top_k < 0:
            raise ValueError(f"generation.top_k={g.top_k} must be >= 0")
        for key in ("top_p", "typical_p"):
            if not 0 < getattr(g, key) <= 1:
                raise ValueError(f"generation.{key}={getattr(g, key)} must be in (0, 1]")
        if not 0.01 <= g.repetition_penalty <= 100:
            raise ValueError(f"generation.repetition_penalty={g.repetition_penalty} must be in "
                             "[0.01, 100]")  # fmt: skip
        if g.seed < -1:
            raise ValueError(f"generation.seed={g.seed} must be >= 0 (or -1: a random seed)")
        s = self.server
        for key in ("max_batch_slots", "max_seq_len", "max_queue", "max_body_bytes",
                    "max_prefill_tokens", "max_header_bytes", "max_connections",
                    "idle_timeout_s", "request_timeout_s", "max_stream_backlog",
                    "max_logit_bias", "max_token_ids", "max_logprob_entries",
                    "max_jobs_per_request", "kv_block_size",
                    "stall_timeout_s"):  # fmt: skip
            if getattr(s, key) <= 0:
                raise ValueError(f"server.{key}={getattr(s, key)} must be > 0")
        if s.kv_cache_tokens < 0:
            raise ValueError(f"server.kv_cache_tokens={s.kv_cache_tokens} must be >= 0 (0: all "
                             "that fits)")  # fmt: skip
        if s.kv_cache_dtype not in ("auto", "model", "int8"):
            raise ValueError(f"server.kv_cache_dtype={s.kv_cache_dtype!r}: expected 'auto', "
                             "'model' or 'int8'")  # fmt: skip
        for key in ("prefill_hold_steps", "max_step_tokens", "sampler_rows"):
            if getattr(s, key) < 0:
                raise ValueError(f"server.{key}={getattr(s, key)} must be >= 0")
        if s.step_buckets != "auto" and not re.fullmatch(r"\s*[1-9]\d*\s*(,\s*[1-9]\d*\s*)*",
                                                          s.step_buckets):  # fmt: skip
            raise ValueError(f"server.step_buckets={s.step_buckets!r}: expected 'auto' or token "
                             "counts such as '1,2,4,8,16,32,64,128,256'")  # fmt: skip
        return self


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_bytes(text: str, what: str) -> int:
    """'24GiB', '22.5 GB', '1048576' -> bytes; a ValueError naming `what` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise ValueError(f"{what}={text!r}: expected a size such as 24GiB or 22.5GB")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def _check_type(key: str, value: Any, annotation: str) -> Any:
    # Annotations are strings because of `from __future__ import annotations`.
    if annotation == "bool":
        if isinstance(value, bool):
            return value
    elif annotation == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation == "str":
        if isinstance(value, str):
            return value
    raise ValueError(
        f"config key {key}: expected {annotation}, got {type(value).__name__} {value!r}"
    )


def closest(word: str, choices, prefix: str = "") -> str:
    """': did you mean X?' for the nearest choice, if one is near."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f": did you mean {prefix}{near[0]}?" if near else ""


def _build(data: dict[str, Any]) -> RunConfig:
    sections = {}
    for sec_field in dataclasses.fields(RunConfig):
        sec_cls = sec_field.default_factory  # type: ignore[misc]
        raw = data.get(sec_field.name, {})
        if not isinstance(raw, dict):
            raise ValueError(f"config section [{sec_field.name}] must be a table")
        known = {f.name: f for f in dataclasses.fields(sec_cls)}
        values = {}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"unknown config key {sec_field.name}.{key}"
                                 f"{closest(key, known, sec_field.name + '.')} (known in "
                                 f"[{sec_field.name}]: {', '.join(known)})")  # fmt: skip
            values[key] = _check_type(f"{sec_field.name}.{key}", value, known[key].type)
        sections[sec_field.name] = sec_cls(**values)
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(f"unknown config section [{unknown[0]}]{closest(unknown[0], sections)} "
                         f"(sections: {', '.join(sections)})")  # fmt: skip
    return RunConfig(**sections).validate()


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected section.key=value")
    dotted, text = item.split("=", 1)
    if dotted.count(".") != 1:
        raise ValueError(f"--set {item!r}: the key must be section.key, got {dotted!r}")
    section, key = dotted.split(".")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string: --set model.path=/data/bloom
    return section, key, value


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML file (or nothing: all defaults) and apply `section.key=value` overrides."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    for item in overrides:
        section, key, value = _parse_override(item)
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ValueError(f"config section [{section}] must be a table")
        data[section][key] = value
    return _build(data)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The options every entry point shares."""
    parser.add_argument("--config", help="TOML config file (configs/*.toml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable)",
    )
    parser.add_argument("--model", help="model directory; shortcut for --set model.path=DIR")
    parser.add_argument("--quant", choices=QUANT_METHODS, help="shortcut for --set quant.method=")
    parser.add_argument("--dtype", choices=DTYPES, help="shortcut for --set model.dtype=")
    parser.add_argument("--gpu-mem", metavar="SIZE",
                        help="GPU memory per rank, e.g. 24GiB: shortcut for --set "
                        "model.memory_budget= (a model over it keeps blocks in host "
                        "memory)")  # fmt: skip
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="every rank logs, at debug level (MPINFER_LOG_LEVEL=DEBUG)",
    )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    if getattr(args, "verbose", False):  # read by dist.setup_logging on every rank
        os.environ["MPINFER_LOG_LEVEL"] = "DEBUG"
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={_toml_str(args.model)}")
    if args.quant:
        overrides.append(f"quant.method={_toml_str(args.quant)}")
    if args.dtype:
        overrides.append(f"model.dtype={_toml_str(args.dtype)}")
    if getattr(args, "gpu_mem", None):
        overrides.append(f"model.memory_budget={_toml_str(args.gpu_mem)}")
    if getattr(args, "host", None):  # the server's shortcuts
        overrides.append(f"server.host={_toml_str(args.host)}")
    if getattr(args, "port", None) is not None:
        overrides.append(f"server.port={args.port}")
    cfg = load_config(args.config, overrides)
    if not cfg.model.path:
        raise ValueError("no model: pass --model DIR or set model.path in the config")
    path = resolve_model(cfg.model.path, cfg.model.revision)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(path: str, revision: str = "") -> str:
    """model.path as a directory: a path that exists is always a path; `org/name` that does not
    is a Hugging Face Hub model id, downloaded (with a progress bar) into the Hub cache, or
    found there offline (HF_HUB_OFFLINE=1); its snapshot directory is the model directory."""
    if Path(path).exists() or not HUB_ID.fullmatch(path):
        return path
    hub = require("huggingface_hub")
    kw = dict(repo_id=path, revision=revision or None)
    try:
        # Weights in safetensors where the repo has them (BLOOM repos also ship .bin, flax, tf).
        local = hub.snapshot_download(**kw, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                            "*.model", "*.jinja"])  # fmt: skip
        if not any(Path(local).glob("*.safetensors")):
            local = hub.snapshot_download(**kw, allow_patterns=["*.json", "*.bin", "*.txt"])
    except hub.errors.RepositoryNotFoundError:
        raise ValueError(f"--model {path}: no such directory here, and no such model on the "
                         "Hugging Face Hub") from None  # fmt: skip
    except hub.errors.RevisionNotFoundError:
        raise ValueError(f"model.revision={revision!r}: not a revision of {path}") from None
    except (hub.errors.LocalEntryNotFoundError, OSError) as e:
        raise ValueError(f"--model {path}: no such directory here, and the Hub model is not in "
                         f"the Hub cache ({hub.constants.HF_HUB_CACHE}) while the Hub cannot be "
                         f"reached ({type(e).__name__}); download it once online, or pass a "
                         "directory") from None  # fmt: skip
    return local


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
