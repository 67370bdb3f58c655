#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call (the device tool's $OUT collects
# the results):  bash scripts/gpu_check.sh [smoke|full]
# Installs carried wheels (bitsandbytes, pytest) into /tmp/site, runs the GPU tests, then the
# benchmarks: smoke = bloom-560m shape only; kernels = the per-shape matmul table only;
# full = the matmul table, the bloom-7b1 shape, the simulated tp-8 rank and the memory planner.
set -uo pipefail
mode=${1:-full}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, bitsandbytes; print(torch.__version__, triton.__version__, transformers.__version__, bitsandbytes.__version__)" | tee -a "$OUT/gpu.txt"
if ! python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py > "$OUT/gpu-tests.txt" 2>&1; then
    tail -25 "$OUT/gpu-tests.txt"
    echo "GPU tests failed: benchmarking without the int8->fp16 bit trick"
    export MPINFER_INT8_MAGIC=0
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k int8_linear 2>&1 | tail -3
fi
tail -3 "$OUT/gpu-tests.txt"
if [ "$mode" = smoke ]; then
    python3 -m mpinfer.cli bench gpu --shape bloom-560m --out "$OUT/gpu-smoke.json" 2>&1 | tail -30
    exit 0
fi
if [ "$mode" = full ]; then
    python3 -m mpinfer.cli bench gpu --shape bloom-7b1 --simulate-tp 8 --memory \
        --out "$OUT/gpu-h200.json" > "$OUT/gpu.log" 2>&1
    tail -40 "$OUT/gpu.log"
fi
timeout "${KERNELS_TIMEOUT:-900}" python3 -m mpinfer.cli bench kernels \
    --out "$OUT/kernels-h200.json" > "$OUT/kernels.log" 2>&1
tail -45 "$OUT/kernels.log"
