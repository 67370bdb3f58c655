#!/usr/bin/env bash
# The multi-GPU runs (issue: tp 2/4/8 on one host with NCCL), ready for a machine with several
# GPUs:  bash scripts/multi_gpu.sh   (results under $OUT, default bench/results/multi)
# 1. correctness: greedy tokens at tp = 2, 4, 8 (as many as there are GPUs) equal tp = 1, on a
#    random BLOOM of bloom-7b1's shape (fp32, quant none: no reduction-order noise in the argmax);
# 2. loading at scale: the rank-0 path from the fp16 checkpoint and the sharded path, per tp:
#    load time and every rank's host RAM (from the load log line);
# 3. decode at scale with real NCCL: mpinfer.tools.tpbench (random int8 weights made on the GPUs):
#    ms/step at batch 1, 8, 32, the all-reduce latency and share, the floor, per-GPU memory;
# 4. the server under tp: mpinfer bench serve's load test is CPU-sized; on GPUs run it with
#    the 7b1-shaped model by hand (see README).
set -uo pipefail
OUT=${OUT:-bench/results/multi}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
ck=/tmp/bloom-7b1-random
[ -f $ck/config.json ] || python3 -m mpinfer.cli make-tiny $ck --layers 30 --hidden 4096 \
    --heads 32 --vocab 250880 --dtype float16 --shards 8 | tee "$OUT/make.txt"
for tp in 1 2 4 8; do
    [ "$tp" -le "$ngpu" ] || continue
    torchrun --standalone --nproc-per-node "$tp" launch/generate.py --model $ck --quant none \
        --dtype float32 --greedy --json --max-new-tokens 32 --prompt "The capital of France is" \
        --prompt "river" > "$OUT/greedy-tp$tp.jsonl" 2> "$OUT/greedy-tp$tp.log"
    grep "loaded in" "$OUT/greedy-tp$tp.log"
    cmp -s "$OUT/greedy-tp1.jsonl" "$OUT/greedy-tp$tp.jsonl" && echo "tp=$tp greedy == tp=1" \
        || echo "tp=$tp greedy DIFFERS from tp=1"
    python3 -m mpinfer.cli shard --model $ck --tp "$tp" --out /tmp/b7-tp$tp | tee "$OUT/shard-tp$tp.txt"
    for src in $ck /tmp/b7-tp$tp; do
        torchrun --standalone --nproc-per-node "$tp" launch/generate.py --model $src \
            --dtype float16 --max-new-tokens 8 2>&1 | grep "loaded in" | tee -a "$OUT/load-tp$tp.txt"
    done
done
for tp in 2 4 8; do
    [ "$tp" -le "$ngpu" ] || continue
    for shape in bloom-7b1 bloom-176b; do
        torchrun --standalone --nproc-per-node "$tp" -m mpinfer.tools.tpbench --shape $shape \
            --out "$OUT/tp$tp-$shape.json" 2>&1 | tail -1
    done
done
