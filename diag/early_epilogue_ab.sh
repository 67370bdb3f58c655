#!/usr/bin/env bash
# One device call: the W8A16 epilogue's operands loaded before the main loop (the default) or
# after it (MPINFER_EARLY_EPILOGUE=0), each in fresh processes: the step's quick rows, then the
# per-shape matmul table at 1 and 32 rows; then a subset of the GPU tests on the default; then
# diag/launch_floor.py.  bash diag/early_epilogue_ab.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for early in 1 0; do
    MPINFER_EARLY_EPILOGUE=$early timeout 100 python3 -m mpinfer.cli bench gpu --shape bloom-7b1 \
        --rows mpinfer-int8,mpinfer-int8-bf16 --simulate-tp 8 --out "$OUT/quick-early$early.json" \
        > "$OUT/quick-early$early.log" 2>&1
    echo "early=$early quick: exit $? at ${SECONDS}s"; grep -v '^{' "$OUT/quick-early$early.log" | tail -9
done
for early in 1 0; do
    MPINFER_EARLY_EPILOGUE=$early timeout 80 python3 -m mpinfer.cli bench kernels --rows 1,32 \
        --bf16-rows 1 --out "$OUT/kernels-early$early.json" > "$OUT/kernels-early$early.log" 2>&1
    echo "early=$early kernels: exit $? at ${SECONDS}s"
done
python3 - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/kernels-early{e}.json")) for e in (1, 0))
old = {(r["shape"], r["M"], r["dtype"]): r["int8_us"] for r in b["rows"]}
print("| shape | rows | dtype | early us | late us | early / late |\n|---|---|---|---|---|---|")
for r in a["rows"]:
    k = (r["shape"], r["M"], r["dtype"])
    if k in old:
        print(f"| {k[0]} | {k[1]} | {k[2]} | {r['int8_us']:.1f} | {old[k]:.1f} | {r['int8_us'] / old[k]:.3f} |")
PY
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
    -k "matches_reference or family or fused_epilogue or graph_equals" > "$OUT/tests.txt" 2>&1
echo "tests: exit $? at ${SECONDS}s"; tail -3 "$OUT/tests.txt"
timeout 90 python3 diag/launch_floor.py | tee "$OUT/launch-floor.md"
echo "done at ${SECONDS}s"
