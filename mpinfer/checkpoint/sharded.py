"""The pre-sharded int8 format: writing it (`mpinfer shard`), verifying it, and the checks a rank
makes before it loads its own file (the load itself: loader.py).

    DIR/mpinfer.json                      manifest, written last (see `write_manifest`)
    DIR/rank-00000-of-00008.safetensors   rank 0's tensors, mpinfer names: int8 + scales
    DIR/config.json, tokenizer files      copied from the source: DIR is a complete model dir

`mpinfer shard` writes the rank files one after another; each reads only its own slices of the
source (plus the small replicated tensors), so every byte of a split tensor is read once in all
and host RAM holds one slice at a time. A rank file is streamed to a temporary name (the
safetensors header is known from the plan before any data is read), hashed as it is written,
renamed when complete and recorded in a journal; an interrupted run leaves only temporary files
and the journal, and a rerun keeps the finished rank files whose checksum still matches. The
manifest is written last, by rename, so a directory with a manifest is a finished one.

`--ranks A-B` writes only those ranks' files (and a manifest listing only them), so each host of
a multi-host job prepares the part its own ranks read.

Loading: each rank checks the manifest against its config and the world size, and its own file
(size, and sha256 unless `model.verify = false`), all before any GPU memory is taken.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import struct
from pathlib import Path

import torch
from tqdm import tqdm

from .. import __version__
from ..config import QuantConfig, RunConfig
from ..model.bloom import DTYPES
from ..model.sharding import rank_entries, shard_tensor, specs_for
from .hf import CheckpointError, inspect_checkpoint, read_config

log = logging.getLogger("mpinfer")

MANIFEST = "mpinfer.json"
JOURNAL = "mpinfer.partial.json"
FORMAT, VERSION = "mpinfer-sharded", 1
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
             torch.uint8: "U8"}  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


def quant_record(q: QuantConfig) -> dict:
    """What the manifest says of the weights' format (int4's group and symmetry too)."""
    out = {"method": q.method, "embeddings": "int8" if q.embeddings == "int8" else "none"}
    if q.method == "int4":
        out.update(group_size=q.group_size, symmetric=q.symmetric)
    return out


def rank_file(rank: int, tp_size: int) -> str:
    return f"rank-{rank:05d}-of-{tp_size:05d}.safetensors"


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class StreamingSafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (every name, dtype, shape and
    offset) goes first, then each tensor's bytes in header order, hashed on the way."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header, offset = {}, 0
        for name, shape, dtype in entries:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {
                "dtype": ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        header["__metadata__"] = {"format": "pt", "producer": f"mpinfer {__version__}"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self.expected = [(n, tuple(s), d) for n, s, d in entries]
        self.path, self.sha, self.nbytes = path, hashlib.sha256(), 0
        self.f = open(path, "wb")
        self._put(struct.pack("<Q", len(blob)) + blob)

    def _put(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.nbytes += len(data)

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self.expected.pop(0)
        assert (name, tuple(t.shape), t.dtype) == want, f"writing {name}, planned {want}"
        self._put(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))

    def close(self) -> str:
        assert not self.expected, f"{len(self.expected)} tensors never written"
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.sha.hexdigest()


def source_fingerprint(model_dir: Path) -> str:
    """config.json's bytes and each weight file's name, size and modification time: cheap
    (a 352 GB source is not hashed), and it changes when a file is rewritten, even to the same
    size, so a finished or half-done output of other weights is not taken for this one's."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.iterdir()):
        if p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json"):
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def shard_checkpoint(
    model_dir: str,
    out_dir: str,
    *,
    tp_size: int,
    quant: str = "int8",
    embeddings: str = "none",
    group_size: int = 128,
    symmetric: bool = False,
    dtype: str = "auto",
    ranks: list[int] | None = None,
    progress: bool = True,
) -> dict:
    """Write DIR (see the module docstring); returns the manifest. Resumes an interrupted run.
    `ranks`: write only these ranks' files (default: all); `group_size` and `symmetric`: int4's
    (quant.py)."""
    if tp_size < 1:
        raise ValueError(f"--tp={tp_size} must be >= 1")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}: expected auto or one of {list(DTYPES)}")
    ranks = sorted(set(range(tp_size) if ranks is None else ranks))
    if not ranks or ranks[0] < 0 or ranks[-1] >= tp_size:
        raise ValueError(
            f"--ranks {ranks}: every rank must be in 0..{tp_size - 1} (--tp={tp_size})"
        )
    qcfg = QuantConfig(method=quant, embeddings=embeddings, group_size=group_size,
                       symmetric=symmetric)  # fmt: skip
    RunConfig(quant=qcfg).validate()  # the same checks (and messages) as a config file's
    config_dict, shape, ckpt = inspect_checkpoint(model_dir, tp_size, qcfg)
    specs = specs_for(shape, tp_size, qcfg)
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the source directory; choose another")
    settings = {
        "format": FORMAT,
        "version": VERSION,
        "tp_size": tp_size,
        "ranks": ranks,
        "quant": quant_record(qcfg),
        "dtype": dtype,
        "source": {"path": str(src.resolve()), "fingerprint": source_fingerprint(src)},
    }
    manifest_path, journal_path = out / MANIFEST, out / JOURNAL
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if all(old.get(k) == v for k, v in settings.items()) and not verify_dir(out, quiet=True):
            log.info("%s is already complete and verified", out)
            return old
        manifest_path.unlink()  # from here on the directory must not look finished
    journal = json.loads(journal_path.read_text()) if journal_path.exists() else {}
    done = journal.get("files", {}) if journal.get("settings") == settings else {}
    for stale in out.glob("*.tmp-*"):
        stale.unlink()

    files = {}
    # The bar counts source bytes as they are read, so its total is the same sum.
    bar = tqdm(total=sum(_read_bytes(ckpt, p, r, tp_size) for r in ranks for p in specs),
               unit="B", unit_scale=True, desc="sharding", disable=not progress,
               mininterval=1.0)  # fmt: skip
    for r in ranks:
        name = rank_file(r, tp_size)
        final = out / name
        rec = done.get(name)
        if (
            rec
            and final.exists()
            and final.stat().st_size == rec["bytes"]
            and (sha256_file(final) == rec["sha256"])
        ):
            log.info("%s: finished by an earlier run, checksum matches; kept", name)
            files[name] = rec
            bar.update(sum(_read_bytes(ckpt, p, r, tp_size) for p in specs))
            continue
        files[name] = _write_rank(ckpt, specs, r, tp_size, dtype, out, name, bar)
        done[name] = files[name]
        _write_json_atomic(journal_path, {"settings": settings, "files": done})
    bar.close()
    side = _copy_side_files(src, out)
    manifest = {
        **settings,
        "model_config": config_dict,
        "files": [{"name": n, **files[n]} for n in sorted(files)],
        "side_files": side,
        "host": socket.gethostname(),
        "mpinfer_version": __version__,
    }
    _write_json_atomic(manifest_path, manifest)
    journal_path.unlink(missing_ok=True)
    return manifest


def _read_bytes(ckpt, spec, r: int, tp_size: int) -> int:
    """Source bytes rank r's file reads of one tensor (all of it, or its slice)."""
    rng = spec.rank_range(r, tp_size)
    shape = list(ckpt.shape(spec.name))
    if rng:
        dim, start, stop = rng
        shape[dim] = stop - start
    return torch.Size(shape).numel() * ckpt.dtype(spec.name).itemsize


def _write_rank(ckpt, specs, r, tp_size, dtype, out, name, bar) -> dict:
    target = None if dtype == "auto" else DTYPES[dtype]  # None: as stored in the source
    entries = []
    for p in specs:
        entries += rank_entries(p, tp_size, target or ckpt.dtype(p.name))
    tmp = out / f"{name}.tmp-{os.getpid()}"
    writer = StreamingSafetensorsWriter(tmp, entries)
    try:
        for p in specs:
            rng = p.rank_range(r, tp_size)
            piece = ckpt.read(p.name, *rng) if rng else ckpt.read(p.name)
            bar.update(piece.numel() * piece.element_size())
            for tname, t in shard_tensor(p, piece, tp_size, target).items():
                writer.write(tname, t)
        sha = writer.close()
    except BaseException:
        writer.f.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out / name)
    return {"bytes": writer.nbytes, "sha256": sha}


def _copy_side_files(src: Path, out: Path) -> list[dict]:
    """config.json, tokenizer and generation files: everything that is not weights; their
    manifest entries (a server reads them too, so `verify` checks them as it checks weights)."""
    entries = []
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix not in WEIGHT_SUFFIXES and not p.name.endswith(".index.json"):
            tmp = out / f"{p.name}.tmp-{os.getpid()}"
            shutil.copyfile(p, tmp)
            os.replace(tmp, out / p.name)
            entries.append({"name": p.name, "bytes": (out / p.name).stat().st_size,
                            "sha256": sha256_file(out / p.name)})  # fmt: skip
    return entries


def verify_dir(out: Path, *, quiet: bool = False) -> list[str]:
    """Every problem with DIR's files against its manifest (an empty list: all good)."""
    manifest = read_manifest(out)
    problems = []
    for f in manifest["files"] + manifest.get("side_files", []):
        path = out / f["name"]
        if not path.exists():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != f["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {f['bytes']}")
        elif sha256_file(path) != f["sha256"]:
            problems.append(f"{path}: sha256 does not match the manifest (altered or corrupt)")
        elif not quiet:
            print(f"ok  {path.name}  {f['bytes']} bytes  sha256 {f['sha256'][:16]}…")
    return problems


def read_manifest(out: Path) -> dict:
    path = Path(out) / MANIFEST
    if not path.exists():
        what = (
            "a model directory that is not sharded"
            if (Path(out) / "config.json").exists()
            else "not a sharded checkpoint"
            if Path(out).is_dir()
            else "not a directory"
        )
        raise CheckpointError(f"{out} has no {MANIFEST}: {what} (`mpinfer shard` writes one; "
                              "an HF checkpoint directory loads as it is)")  # fmt: skip
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: manifest version {manifest.get('version')!r} is not supported "
            f"(this mpinfer {__version__} reads version {VERSION}); re-run `mpinfer shard`"
        )
    return manifest


# -- checks at load time ---------------------------------------------------------------------
def is_sharded(path: str) -> bool:
    p = Path(path)
    if (p / MANIFEST).is_file():
        return True
    if any(p.glob("rank-*-of-*.safetensors*")) and not any(p.glob("model*.safetensors")):
        raise CheckpointError(
            f"{p} holds rank files but no {MANIFEST}: an unfinished `mpinfer shard`; run it again"
        )
    return False


def check_rank(cfg: RunConfig, manifest: dict, out: Path, rank: int, world: int) -> None:
    """This rank's checks, all before any device memory is touched."""
    tp = manifest["tp_size"]
    if cfg.parallel.tp_size and cfg.parallel.tp_size != world:
        raise ValueError(
            f"parallel.tp_size={cfg.parallel.tp_size} does not match the world size {world}"
        )
    if tp != world:
        raise ValueError(
            f"{out} was sharded for tp_size={tp}, but the world size is {world}: start "
            f"{tp} ranks (torchrun --nproc-per-node {tp}) or re-shard with --tp {world}"
        )
    stored, asked = manifest["quant"], cfg.quant
    int8_like = {"int8", "llm.int8"}  # the same stored format: int8 rows + float32 scales
    if not (stored["method"] == asked.method or {stored["method"], asked.method} <= int8_like):
        raise ValueError(
            f"{out} holds quant.method={stored['method']!r} weights, the config asks for "
            f"quant.method={asked.method!r}: set quant.method={stored['method']!r} or re-shard"
        )
    if asked.embeddings != "auto" and stored["embeddings"] != asked.embeddings:
        raise ValueError(
            f"{out} holds quant.embeddings={stored['embeddings']!r}, the config asks for "
            f"quant.embeddings={asked.embeddings!r}"
        )
    for key in ("group_size", "symmetric"):
        if key in stored and stored[key] != getattr(asked, key):
            raise ValueError(f"{out} holds int4 weights with quant.{key}={stored[key]!r}, the "
                             f"config asks for quant.{key}={getattr(asked, key)!r}")  # fmt: skip
    if read_config(out) != manifest["model_config"]:
        raise ValueError(f"{out}/config.json does not match the model config in its manifest")
    host = socket.gethostname()
    entry = next((f for f in manifest["files"] if f["name"] == rank_file(rank, tp)), None)
    if entry is None:
        raise ValueError(
            f"rank {rank} on host {host}: {out}/{MANIFEST} lists no {rank_file(rank, tp)} "
            f"(this directory holds ranks {manifest.get('ranks', 'all')}): run `mpinfer shard "
            f"--ranks` for this host's ranks"
        )
    path = out / entry["name"]
    if not path.is_file():
        raise CheckpointError(f"rank file {path} is missing (rank {rank} on host {host})")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(
            f"rank file {path} has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
        )
    if cfg.model.verify and sha256_file(path) != entry["sha256"]:
        raise CheckpointError(f"rank file {path}: sha256 does not match the manifest (altered?)")
