#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call (the device tool's $OUT collects
# the results):  bash scripts/gpu_check.sh [smoke|quick|kernels|full|tune]
# Installs carried wheels (bitsandbytes, pytest) into /tmp/site, runs the benchmarks, then the
# GPU tests (after the benchmarks, so they reuse the kernels the benchmarks compiled; a run's
# numbers count only if its tests pass), then the per-shape matmul table as far as time allows.
# smoke = the bloom-560m shape; quick = mpinfer's int8 rows of the bloom-7b1 shape and the
# simulated tp-8 rank; kernels = the matmul table only; full = every row of the bloom-7b1
# shape, the simulated tp-8 rank and (unless NO_MEMORY=1) the memory planner against the GPU;
# tune = sweep the W8A16 configs of every matmul shape of both models at 1, 8, 32 and 64 rows
# into this GPU's table (mpinfer/kernels/tuned/<gpu>.json, copied to $OUT to ship), then the
# GPU tests, which run on the new table.
# Every stage has a time limit, so one that hangs still leaves the others' results under $OUT.
set -uo pipefail
mode=${1:-full}
OUT=${OUT:-bench/results}
BUDGET=${BUDGET:-575}  # seconds for the whole call (the device tool allows 600)
mkdir -p "$OUT"
left() { echo $((BUDGET - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, bitsandbytes; print(torch.__version__, triton.__version__, transformers.__version__, bitsandbytes.__version__)" | tee -a "$OUT/gpu.txt"
bench() {  # bench gpu with the given arguments, its log in $OUT/gpu.log
    timeout "${GPU_TIMEOUT:-$(($(left) - ${TESTS_TIME:-200}))}" python3 -m mpinfer.cli bench gpu \
        "$@" > "$OUT/gpu.log" 2>&1
    grep -v '^{' "$OUT/gpu.log" | tail -30
    echo "bench gpu done at ${SECONDS}s"
}
memory=--memory
[ "${NO_MEMORY:-0}" = 1 ] && memory=
vs_autotune=  # VS_AUTOTUNE=1: also time the autotuner's pick of every launch (about 150 s more)
[ "${VS_AUTOTUNE:-0}" = 1 ] && vs_autotune=--vs-autotune
case "$mode" in
tune) table=mpinfer/kernels/tuned/$(python3 -c "import torch; from mpinfer.kernels.tuning \
          import slug; print(slug(torch.cuda.get_device_name()))").json
      timeout "$(($(left) - ${TESTS_TIME:-230}))" python3 -m mpinfer.cli bench kernels \
          --tune "$table" --rows 1,8,32,64 --bf16-rows 1,8,32,64 $vs_autotune \
          --out "$OUT/kernels-h200-tune.json" > "$OUT/tune.log" 2>&1
      echo "tune: exit $? at ${SECONDS}s"; grep -v '^{' "$OUT/tune.log" | tail -90
      cp "$table" "$OUT/" ;;
smoke) bench --shape bloom-560m --out "$OUT/gpu-smoke.json" ;;
quick) bench --shape bloom-7b1 --rows mpinfer-int8,mpinfer-int8-bf16 --simulate-tp 8 \
           --out "$OUT/gpu-quick.json" ;;
full) bench --shape bloom-7b1 --simulate-tp 8 $memory --out "$OUT/gpu-h200.json" ;;
esac
timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
    > "$OUT/gpu-tests.txt" 2>&1
echo "GPU tests: exit $? (124: timed out)"
tail -15 "$OUT/gpu-tests.txt"
echo "tests done at ${SECONDS}s"
if [ "$mode" = kernels ] || { [ "$mode" != tune ] && [ "$(left)" -gt 60 ]; }; then
    timeout "$(left)" python3 -m mpinfer.cli bench kernels --rows "${KERNEL_ROWS:-1,8,32}" \
        --out "$OUT/kernels-h200.json" > "$OUT/kernels.log" 2>&1
    tail -45 "$OUT/kernels.log"
fi
echo "done at ${SECONDS}s"
