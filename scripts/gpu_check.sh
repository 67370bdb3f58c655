#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call (the device tool's $OUT collects
# the results):  bash scripts/gpu_check.sh [serve|full|quick|smoke|kernels|tune]
# Installs carried wheels (.whl: fastapi, uvicorn and their pydantic/starlette/opentelemetry,
# bitsandbytes, py-spy) into /tmp/site, then:
#   final   the served speed, every row of `mpinfer bench gpu` with the simulated tp-8 rank and
#           the memory planner, then the GPU tests (what the README and docs/performance.md quote)
#   serve   the GPU tests, the served speed (`mpinfer bench serve --gpu --profile`: a random
#           bloom-7b1 checkpoint, the real server, streaming clients, the engine's step and the
#           transformers baseline in one run) and the decode-step benchmark's int8 rows
#   full    every row of `mpinfer bench gpu` on the bloom-7b1 shape, the simulated tp-8 rank and
#           the memory planner against the GPU, then the GPU tests
#   quick   mpinfer's int8 rows of the bloom-7b1 shape and the simulated tp-8 rank, then tests
#   smoke   the bloom-560m shape; kernels: the matmul table; tune: re-tune this GPU's table
# Every stage has a time limit, so one that hangs still leaves the others' results under $OUT.
set -uo pipefail
mode=${1:-serve}
OUT=${OUT:-bench/results}
BUDGET=${BUDGET:-575}  # seconds for the whole call (the device tool allows 600)
mkdir -p "$OUT"
left() { echo $((BUDGET - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# (at most 8 files come back from $OUT: the machine's description goes to stdout only)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
tests() {  # the GPU tests (TESTS_K: a -k selection), within $1 seconds
    timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
        ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu-tests.txt" 2>&1
    echo "GPU tests: exit $? (124: timed out) at ${SECONDS}s"; tail -15 "$OUT/gpu-tests.txt"
}
bench() {  # bench gpu with the given arguments, within $1 seconds
    local t=$1; shift
    timeout "$t" python3 -m mpinfer.cli bench gpu "$@" > "$OUT/gpu.log" 2>&1
    echo "bench gpu: exit $? at ${SECONDS}s"; grep -v '^{' "$OUT/gpu.log" | tail -25
}
case "$mode" in
final)  # the served speed, every decode-step row and the planner, then the GPU tests
    timeout 170 python3 -m mpinfer.cli bench serve --gpu --profile --out "$OUT/serve-gpu.json" \
        > "$OUT/serve.log" 2>&1
    echo "bench serve --gpu: exit $? at ${SECONDS}s"; tail -32 "$OUT/serve.log"
    bench "$(($(left) - ${TESTS_TIME:-170}))" --shape bloom-7b1 --simulate-tp 8 --memory \
        --out "$OUT/gpu-h200.json"
    tests "$(left)" ;;
serve)
    tests "${TESTS_TIME:-170}"
    timeout "$(($(left) - ${QUICK_TIME:-110}))" python3 -m mpinfer.cli bench serve --gpu \
        --profile --out "$OUT/serve-gpu.json" > "$OUT/serve.log" 2>&1
    echo "bench serve --gpu: exit $? at ${SECONDS}s"; tail -40 "$OUT/serve.log"
    bench "$(($(left) - 5))" --shape bloom-7b1 --rows mpinfer-int8 --out "$OUT/gpu-quick.json" ;;
full) bench "$(($(left) - 200))" --shape bloom-7b1 --simulate-tp 8 --memory \
          --out "$OUT/gpu-h200.json"; tests "$(left)" ;;
quick) bench "$(($(left) - 200))" --shape bloom-7b1 --rows mpinfer-int8,mpinfer-int8-bf16 \
           --simulate-tp 8 --out "$OUT/gpu-quick.json"; tests "$(left)" ;;
smoke) bench "$(($(left) - 200))" --shape bloom-560m --out "$OUT/gpu-smoke.json"; tests "$(left)" ;;
kernels) timeout "$(left)" python3 -m mpinfer.cli bench kernels --rows "${KERNEL_ROWS:-1,8,32}" \
             --out "$OUT/kernels-h200.json" > "$OUT/kernels.log" 2>&1; tail -45 "$OUT/kernels.log" ;;
tune) table=mpinfer/kernels/tuned/$(python3 -c "import torch; from mpinfer.kernels.tuning \
          import slug; print(slug(torch.cuda.get_device_name()))").json
      timeout "$(($(left) - 230))" python3 -m mpinfer.cli bench kernels --tune "$table" \
          --rows 1,8,32,64 --bf16-rows 1,8,32,64 --out "$OUT/kernels-h200-tune.json" \
          > "$OUT/tune.log" 2>&1
      echo "tune: exit $? at ${SECONDS}s"; grep -v '^{' "$OUT/tune.log" | tail -90
      cp "$table" "$OUT/"; tests "$(left)" ;;
esac
echo "done at ${SECONDS}s"
