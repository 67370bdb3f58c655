#!/usr/bin/env bash
# The L2 prefetch (mpinfer/kernels/prefetch.py) measured on the GPU machine in one call: the
# quick benchmark (mpinfer's int8 rows of the bloom-7b1 shape, the simulated 176B tp-8 rank)
# with MPINFER_L2_PREFETCH=0, attn and all, each in a fresh process; then the full benchmark and
# the GPU tests with the mode whose batch-1 steps were fastest (bloom-7b1 and the 176B rank,
# fp16 activations, each relative to no prefetch). Results under $OUT: pf-<mode>.md, the full
# run's gpu-h200.{json,md}, gpu-tests.txt, gpu.txt.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
start=$SECONDS
for m in 0 attn all; do
    MPINFER_L2_PREFETCH=$m OUT=/tmp/pf-$m SKIP_TESTS=1 NO_KERNELS=1 BUDGET=150 TESTS_TIME=0 \
        bash scripts/gpu_check.sh quick > /tmp/pf-$m.log 2>&1
    cp /tmp/pf-$m/gpu-quick.md "$OUT/pf-$m.md"
    echo "MPINFER_L2_PREFETCH=$m"; grep -E "mpinfer-int8|BLOOM-176B" /tmp/pf-$m/gpu-quick.md | cut -c1-200
done
best=$(python3 - <<'PY'
import json
t = {}
for m in ("0", "attn", "all"):
    d = json.load(open(f"/tmp/pf-{m}/gpu-quick.json"))
    t[m] = (d["rows"][0]["decode_ms"]["1"], d["simulate_tp"][0]["decode_ms"]["1"])
score = {m: a / t["0"][0] + b / t["0"][1] for m, (a, b) in t.items()}
best = min(score, key=score.get)
print(best if score[best] < 2 - 0.01 else "0")  # a mode must beat none by 0.5 % on average
PY
)
echo "fastest: MPINFER_L2_PREFETCH=$best, after $((SECONDS - start)) s"
MPINFER_L2_PREFETCH=$best OUT=$OUT NO_KERNELS=1 BUDGET=$((570 - SECONDS)) \
    bash scripts/gpu_check.sh full
rm -f "$OUT/gpu.log"
