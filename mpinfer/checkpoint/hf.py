"""Read HF-format checkpoints lazily, one tensor slice at a time.

Handles what `save_pretrained` and the original bigscience repos write: `model.safetensors`,
`model.safetensors.index.json` + shards, `pytorch_model.bin`, `pytorch_model.bin.index.json` +
shards, with or without the `transformer.` key prefix. safetensors slices are read with
`get_slice` (only the bytes of that slice); `.bin` files are opened with `mmap=True,
weights_only=True`, so slicing touches only the pages of that slice. What is not here: the
sharded int8 format mpinfer writes (see `sharded.py`).

`inspect_checkpoint` checks a directory against the model its config.json describes (every
tensor present, every shape as the sharding specs expect) before a byte of weights is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..model.bloom import BloomShape
from ..model.sharding import ShardSpec, specs_for

# Larger than any real config.json (a few KB) by far; a bigger file is not one.
MAX_CONFIG_BYTES = 1 << 20
# A safetensors header lists its tensors: a BLOOM-176B shard's is a few hundred KB. A bigger one
# would be parsed into memory before a single check (90 MB took 1.5 GB of RAM).
MAX_HEADER_BYTES = 16 << 20


def check_header(path: Path) -> None:
    """Refuse a safetensors file whose header length is impossible, before it is parsed."""
    with open(path, "rb") as f:
        head = f.read(8)
    size = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < size <= MAX_HEADER_BYTES or size + 8 > path.stat().st_size:
        raise CheckpointError(f"checkpoint file {path}: a safetensors header of {size:,} bytes "
                              f"(at most {MAX_HEADER_BYTES:,}, within the file)")  # fmt: skip


PREFIX = "transformer."
# Tensors a BLOOM checkpoint may hold that the model does not use (the LM head is tied).
IGNORED = ("lm_head.weight",)


SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F64": torch.float64,
}


class CheckpointError(ValueError):
    """The checkpoint on disk is missing, unreadable or does not match the model."""


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if Path(model_dir).is_file():
        raise CheckpointError(f"--model {model_dir} is a file; expected a model directory "
                              "(config.json, tokenizer.json and the weights)")  # fmt: skip
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist (a Hub model id is "
                              "org/name)")  # fmt: skip
    if not path.is_file():
        held = sorted(p.name for p in Path(model_dir).iterdir())[:6]
        raise CheckpointError(f"{model_dir} has no config.json, so it is not a model directory "
                              f"(it holds: {', '.join(held) or 'nothing'})")  # fmt: skip
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path} is {path.stat().st_size:,} bytes: not a model config "
                              f"(at most {MAX_CONFIG_BYTES:,})")  # fmt: skip
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON: {str(e)[:200]}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def _strip(name: str) -> str:
    return name[len(PREFIX) :] if name.startswith(PREFIX) else name


class HFCheckpoint:
    """Name -> (file, stored key) map over an HF checkpoint directory, read slice by slice."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        self._handles: dict[Path, object] = {}
        self.files = self._find_files()
        self._where: dict[str, tuple[Path, str]] = {}
        for path, keys in self.files.items():
            for key in keys:
                if _strip(key) not in IGNORED:
                    self._where[_strip(key)] = (path, key)

    # -- discovery -----------------------------------------------------------------------------
    def _find_files(self) -> dict[Path, list[str]]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.dir / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                    items = list(weight_map.items())
                except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                        AttributeError, RecursionError) as e:  # fmt: skip
                    raise CheckpointError(f"{index} is not a valid index: {str(e)[:200]}") from None
                by_file: dict[Path, list[str]] = {}
                root = self.dir.resolve()
                for key, fname in items:
                    path = self.dir / str(fname)
                    # The weights must be the model directory's own: no ../, no absolute paths.
                    if not isinstance(fname, str) or root not in path.resolve().parents:
                        raise CheckpointError(f"{index} names {fname!r} for {key}: not a file "
                                              f"inside {self.dir}")  # fmt: skip
                    by_file.setdefault(path, []).append(key)
                for path in by_file:
                    if not path.is_file():
                        raise CheckpointError(
                            f"checkpoint file {path} (named in {index}) is missing"
                        )
                    self._check_readable(path)
                return by_file
        for single in ("model.safetensors", "pytorch_model.bin"):
            path = self.dir / single
            if path.is_file():
                return {path: self._keys_of(path)}
        raise CheckpointError(
            f"no weights in {self.dir}: expected model.safetensors, pytorch_model.bin "
            "or an index (*.index.json)"
        )

    @staticmethod
    def _check_readable(path: Path) -> None:
        if not os.access(path, os.R_OK):
            raise CheckpointError(f"checkpoint file {path} is not readable")

    def _keys_of(self, path: Path) -> list[str]:
        self._check_readable(path)
        return list(self._open(path).keys())

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is not None:
            return handle
        try:
            if path.suffix == ".safetensors":
                check_header(path)
                handle = safe_open(str(path), framework="pt")
            else:
                # mmap: tensors stay on disk until sliced; weights_only: no pickled code runs.
                handle = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # safetensors and torch raise several types for a bad file
            raise CheckpointError(f"checkpoint file {path} cannot be read: {e}") from None
        self._handles[path] = handle
        return handle

    # -- reading -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        path, key = self._locate(name)
        handle = self._open(path)
        if path.suffix == ".safetensors":
            return tuple(handle.get_slice(key).get_shape())
        return tuple(handle[key].shape)

    def dtype(self, name: str) -> torch.dtype:
        path, key = self._locate(name)
        handle = self._open(path)
        if path.suffix == ".safetensors":
            return SAFETENSORS_DTYPES[handle.get_slice(key).get_dtype()]
        return handle[key].dtype

    def _locate(self, name: str) -> tuple[Path, str]:
        if name not in self._where:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.dir}")
        return self._where[name]

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int = 0
    ) -> torch.Tensor:
        """The whole tensor, or rows/columns [start, stop) along `dim` (0 or 1); a fresh copy."""
        path, key = self._locate(name)
        handle = self._open(path)
        try:
            if path.suffix == ".safetensors":
                sl = handle.get_slice(key)
                if dim is None:
                    return sl[:]
                return sl[start:stop] if dim == 0 else sl[:, start:stop]
            t = handle[key]
            if dim is not None:
                t = t[start:stop] if dim == 0 else t[:, start:stop]
            return t.clone()  # detach from the mmap so the pages can go
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"reading {name} from {path} failed: {e}") from None

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def check_checkpoint(ckpt: HFCheckpoint, specs: list[ShardSpec]) -> None:
    for spec in specs:
        if spec.name not in ckpt:
            raise CheckpointError(
                f"tensor {spec.name} is missing from the checkpoint in {ckpt.dir}"
            )
        found = ckpt.shape(spec.name)
        if tuple(found) != spec.shape:
            raise CheckpointError(
                f"tensor {spec.name} has shape {tuple(found)} in the checkpoint, "
                f"but config.json implies {spec.shape}"
            )


def inspect_checkpoint(model_dir: str, tp_size: int, quant) -> tuple[dict, BloomShape,
                                                                    HFCheckpoint]:  # fmt: skip
    """Read config.json and check every tensor's presence and shape (no weights read); `quant`
    the run's [quant] section (its int4 group size must divide every matrix's rank slice)."""
    config_dict = read_config(model_dir)
    shape = BloomShape.from_config(config_dict)
    shape.check_tp(tp_size)
    ckpt = HFCheckpoint(model_dir)
    check_checkpoint(ckpt, specs_for(shape, tp_size, quant))
    return config_dict, shape, ckpt
