"""Optional dependencies, named in one place.

`pip install mpinfer` serves int8 models: torch, safetensors, tokenizers, FastAPI and uvicorn.
What some paths need beyond that is imported where it is used, inside the function that needs
it, and only the modules listed in `LAZY` may be imported that way (tests/test_architecture.py
checks it): each is either an extra (`pip install 'mpinfer[NAME]'`) or needs a GPU.

`require(module)` imports one of them or raises a `ValueError` that names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> (extra that installs it, or "" where it comes with a CUDA build of torch; why)
LAZY: dict[str, tuple[str, str]] = {
    "bitsandbytes": ("llm-int8", "quant.method='llm.int8'"),
    "transformers": ("bench", "the transformers baselines of the benchmarks"),
    "accelerate": ("bench", "the transformers + accelerate offload baseline of the benchmarks"),
    "aiohttp": ("bench", "the served-speed benchmark's streaming clients"),
    "triton": ("", "the GPU kernels (it comes with CUDA builds of torch)"),
    "pynvml": ("", "GPU utilization in the served benchmark (nvidia-ml-py; optional there)"),
    # A dependency, imported only when --model names a Hub model (it takes half a second).
    "huggingface_hub": ("", "a Hub model id as --model"),
    # Other libraries' kernels, timed beside ours by `mpinfer bench kernels --candidates`.
    "torchao": ("", "a candidate kernel of mpinfer bench kernels"),
    "gemlite": ("", "a candidate kernel of mpinfer bench kernels"),
    "humming": ("", "a candidate kernel of mpinfer bench kernels (humming-kernels)"),
    # The kernels themselves import Triton at the top, so they are imported on a GPU only.
    "mpinfer.model.kernels.w8a16": ("", "the int8 matmul on a GPU"),
    "mpinfer.model.kernels.w8a16_convert": ("", "the int8 matmul's conversions (w8a16.py's)"),
    "mpinfer.model.kernels.w8a16_tma": ("", "the int8 matmul's warp-specialized loop on a GPU"),
    "mpinfer.model.kernels.w4a16": ("", "the int4 matmul on a GPU"),
    "mpinfer.model.kernels.w4a16_convert": ("", "the int4 matmul's conversions (w4a16.py's)"),
    "mpinfer.model.kernels.dequant": ("", "the matmuls of more than 256 rows on a GPU"),
    "mpinfer.model.kernels.launch": ("", "the matmuls' shared epilogue on a GPU"),
    "mpinfer.model.kernels.attention": ("", "the decode attention on a GPU"),
    "mpinfer.model.kernels.layernorm": ("", "the decode LayerNorm on a GPU"),
}


def require(module: str) -> ModuleType:
    """`import module`, or a ValueError saying which extra installs it."""
    extra, why = LAZY[module.split(".")[0] if module.split(".")[0] in LAZY else module]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = (
            f"pip install 'mpinfer[{extra}]'"
            if extra
            else "a CUDA build of torch"
            if module.startswith(("triton", "mpinfer.model.kernels"))
            else f"pip install {module}"
        )
        raise ValueError(f"{why} needs {module.split('.')[0]}, which is not available ({e}): "
                         f"{hint}") from None  # fmt: skip
