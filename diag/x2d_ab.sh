#!/usr/bin/env bash
# One device call: the one-row loop with x loaded in the weight tile's layout (MPINFER_X2D=1)
# or as a 1-D row moved through shared memory (=0): the one-row launches (diag/fma_ab.py) and
# the step's quick rows, each way in fresh processes; then GPU tests on X2D=1.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for v in 1 0; do
    MPINFER_X2D=$v timeout 110 python3 diag/fma_ab.py "$OUT/fma-x2d$v.json" > "$OUT/fma-x2d$v.md" 2>&1
    echo "x2d=$v fma: exit $? at ${SECONDS}s"; cat "$OUT/fma-x2d$v.md" | tail -9
done
for v in 1 0; do
    MPINFER_X2D=$v timeout 100 python3 -m mpinfer.cli bench gpu --shape bloom-7b1 \
        --rows mpinfer-int8,mpinfer-int8-bf16 --simulate-tp 8 --out "$OUT/quick-x2d$v.json" \
        > "$OUT/quick-x2d$v.log" 2>&1
    echo "x2d=$v quick: exit $? at ${SECONDS}s"; grep -v '^{' "$OUT/quick-x2d$v.log" | grep "mpinfer-int8\|BLOOM-176B" | cut -c1-400
done
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
    -k "matches_reference or family or fused_epilogue or one_row or graph_equals" > "$OUT/tests.txt" 2>&1
echo "tests: exit $? at ${SECONDS}s"; tail -3 "$OUT/tests.txt"
