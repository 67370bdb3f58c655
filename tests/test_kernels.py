"""The GPU kernels on the CPU: Triton's interpreter (TRITON_INTERPRET=1) runs the W8A16 and W4A16
matmuls (every loop, uneven splits, tiles of rows past 64, the fused epilogue) and the
dequantizers on CPU tensors, against the pure-torch reference on fresh random inputs
(tests/kernel_interp_worker.py). CI installs Triton beside the CPU build of torch for this (the
Makefile); on a GPU the same kernels are compiled and tests/test_gpu.py checks them."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ENV, ROOT


def test_the_matmul_kernels_match_the_reference_under_the_interpreter():
    proc = subprocess.run([sys.executable, "tests/kernel_interp_worker.py"], cwd=ROOT,
                          env={**ENV, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") >= 20, proc.stdout
