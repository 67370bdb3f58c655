#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call per mode (the device tool's $OUT
# collects the results as one results.tgz, refreshed after every stage, so a stage that hangs or
# a call that runs out of time still leaves what the others measured):
#   bash scripts/gpu_check.sh MODE [MODE ...]
# Installs carried wheels (.whl: fastapi, uvicorn and their pydantic/starlette/opentelemetry,
# the candidate kernel libraries; .whl-bnb: bitsandbytes) into /tmp/site, then per mode:
#   tune      re-tune this GPU's kernel table for the tiled int8 buckets (128-1024 rows) and
#             every int4 bucket, fp16 and bf16 (mpinfer bench kernels --tune)
#   tune4     the same for int4 alone
#   kernels   the matmul table at 1-576 rows, int8 and int4 beside cuBLAS fp16
#   candidates  other libraries' kernels beside ours (bench kernels --candidates all)
#   kernel-tests  the kernels' GPU tests (TESTS_K: another -k filter); tests: every GPU test, the
#             engine's first (the kernels' alone outlast one call on an H100: TESTS_K splits them)
#   serve     the served speed (mpinfer bench serve --gpu)
#   budget    the server's memory against its budget under load, the sustained mixes with their
#             prefix-cache hit rates, offload through the server, int4 served (bench budget)
#   int4-row1 re-tune the one-row int4 loop, its kernel table, every family's GPU test
#   r5-kernels  round 5: re-tune the one-row int4 and the tiled int8 launches (fp16), the matmul
#             table, the kernels' GPU tests; r5-serve: int4 decode steps (7b1, 176B on one GPU),
#             then the budget servers (BUDGETS, default 6GiB,6GiB-twin,24GiB)
#   r6-h200   round 6, on an H200: re-tune the one-row int4 launches (magic5), int4 decode steps
#             (7b1), BLOOM-176B int4 whole on the GPU; r6-offload: the 6 GiB offloaded server
#             (OFFLOAD_SECONDS of 128 clients) and its resident twin
#   tune8-decode  re-tune the int8 launches of 1-64 rows and of the 512-row bucket
#   mixed-profile  the engine in-process under the unique mix: each step's GPU time, idle gaps
#             and host time by bucket; synthetic mixed steps; a decode and a 100-token step's
#             kernels (PREFILL: prompt budgets to compare; PROFILE_ARGS=--kv-int8: int8 KV)
#   dequant-ab  the same loop with launches past 256 rows dequantizing (shipped) or in registers
#   r8-kernels  round 8: re-tune the tiled int8 launches (128-512 rows, with the swap loop's
#             pair conversion, magic6) for MODELS8, the matmul table, the kernels' GPU tests
#   r8-mix    the unique mix in-process as round 7 shipped it (no step cap, dequantized past 256
#             rows) and as now (steps of at most 512 tokens, the GPU's crossover), then the
#             served 24 GiB server's sustained phases (bench budget)
#   r9-h200   round 9, on an H200: BLOOM-176B int4 whole on one GPU, 7b1 int4 beside int8, the
#             tiled int8 launches re-tuned with magic6
#   r9-kernels  round 9: the tiled int8 launches re-tuned (7b1 128-512 rows, the 176B tp-8 rank
#             128 and 256), the matmul table; r9-serve: on that warm machine, its table, the
#             kernels' GPU tests, the served unique mix at 32 clients
#   r9-kv     the decode attention over fp16 and int8 KV caches (KV_OLD: an older copy of the
#             kernels to compare), its GPU tests, the unique mix in-process with each cache
#   r10-sampler  round 10: the sampler's pass by rows and kind (diag.sampler_cost), the unique mix
#             in-process sampled at temperature 1 with the old and the new draw and greedy, then
#             the served unique mix at 32 clients (the load generator's requests sample)
#   r11-int4  round 11: the int4 families' GPU tests, the one- and 16-row int4 launches re-tuned
#             (MODELS4), bloom-7b1 int4 beside int8, BLOOM-176B int4 on a GPU of 120 GB or more
#   r12-int4-ab  the shipped table against the same re-tuned at 16 rows (magic7), one machine,
#             alternating decode benches (bloom-7b1; BLOOM-176B on a GPU of 120 GB or more)
#   r12-magic8  int4's one-row loop in packed fp16: its family test, the one-row launches
#             re-tuned, then the shipped table against the re-tuned one (bloom-7b1, BLOOM-176B)
#   r13-tma   int8's warp-specialized loop: its family test, the tiled launches re-tuned, the
#             matmul table (the re-tuned table is left in $RES and /tmp)
#   r13-mix   after r13-tma: the unique mix in-process, the shipped table against the re-tuned
#   r15-fewrow  the few-row tma loop: family test, 32/64-row int8 launches re-tuned, the matmul
#             table, the unique mix A/B (then r9-serve on the same machine serves its table)
#   ab-old    this tree's code against an older tree's (.ab/old, carried), same table: decode
#             steps and the unique mix, alternating
#   r16-attn  the decode attention over mixed histories by split count, the unique mix with the
#             attention's splits before round 16 against now (MPINFER_ATTN_MIN_SPLITS), budget tests
#   r17-int4-read  the one-row int4 loop against plain reads of its bytes (contiguous, its
#             tiles), then Nsight Compute on BLOOM-176B's qkv launch
#   step-cap  the unique mix at step caps of 256, 384 and 512 tokens (ITL p99 against TTFT p99),
#             then the decode step at batch 32, context 128
#   step-cap-served  the same served (`mpinfer serve`, 32 HTTP clients) per SERVED_ARMS: step
#             cap, KV cache dtype, MPINFER_* switches
#   r18-kv8   the int8 cache's decode attention: the biased route (default since round 19),
#             the exact loop, 64-key tiles; its GPU tests; the int8-KV mix at a 256 cap by arm
#   rank-fit  one card of the 176B 8x24 GB configs (int8, int4) on one GPU: a simulated tp-8
#             rank started under 24,564 MiB, its stages and KV pool against the plan, a burst
#   r21-int4-lines  the one-row int4 loop (magic8/9) loading whole lines (w4a16.LINES) and
#             with parts of its work left out, beside plain reads; Nsight Compute on BLOOM-176B's
#             qkv; the one-row launches re-tuned with whole lines; the family test; decode
#             steps (bloom-7b1; BLOOM-176B where it fits), shipped against lines, alternating
#             (r21-int4-ab: those steps alone, on the same warm machine)
#   ncu       Nsight Compute's counters of single matmul launches (NCU_RUNS, diag.matmul_profile)
#   int4      decode steps of int4 beside int8 (bloom-7b1); int4-176b: BLOOM-176B int4 whole on
#             one GPU
#   final     budget, int4, int4-176b, kernels, then the GPU tests
# Every stage has a time limit (BUDGET seconds in all, default 570).
set -uo pipefail
OUT=${OUT:-bench/results}
RES=/tmp/results
BUDGET=${BUDGET:-570}
mkdir -p "$OUT" "$RES"
left() { echo $((BUDGET - SECONDS)); }
pack() { tar czf "$OUT/results.tgz" -C /tmp results 2>/dev/null; }
wheels=$(ls .whl/*.whl .whl-bnb/*.whl 2>/dev/null)
[ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site $wheels
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
table=mpinfer/model/kernels/tuned/$(python3 -c "import torch; from mpinfer.model.kernels.tuning \
    import slug; print(slug(torch.cuda.get_device_name()))").json
stage() {  # stage NAME SECONDS CMD...: run CMD within SECONDS (or what is left), log to RES/NAME.log
    local name=$1 t=$2; shift 2
    [ "$t" -gt "$(left)" ] && t=$(left)
    [ "$t" -lt 10 ] && { echo "$name: skipped (no time left)"; return; }
    timeout "$t" bash -c '"$@"' _ "$@" > "$RES/$name.log" 2>&1
    echo "== $name: exit $? (124: timed out) at ${SECONDS}s"; grep -v '^{' "$RES/$name.log" | tail -${TAIL:-12}
    pack
}
bench() { python3 -m mpinfer.cli bench "$@"; }
pytest_gpu() { python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
gpu_tests() { pytest_gpu tests/test_gpu.py tests/test_gpu_engine.py "$@"; }
export -f bench pytest_gpu gpu_tests
step_b32() {  # the decode step at batch 32, context 128 (#44's ITL p99 target is 3 x it)
    TAIL=4 stage step-b32 60 bench gpu --shape bloom-7b1 --rows mpinfer-int8 --batches 32 \
        --context 128 --out "$RES/step-b32.json"
}
[ "${1:-}" = final ] && set -- budget int4 int4-176b kernels tests
for mode in "$@"; do case "$mode" in
tune)
    rows=128,256,512,576
    TAIL=4 stage tune-int8 170 bench kernels --tune "$table" --quant int8 --rows $rows \
        --bf16-rows $rows --out "$RES/tune-int8.json"
    rows=1,16,32,64,128,256,512,576
    TAIL=4 stage tune-int4 230 bench kernels --tune "$table" --quant int4 --rows $rows \
        --bf16-rows $rows --out "$RES/tune-int4.json"
    cp "$table" "$RES/" ;;
r5-kernels)  # round 5: the one-row int4 loop (magic4/5) and the tiled int8 loops (256-row tiles)
    # re-tuned in fp16 (the table keeps its other entries), then the matmul table; the table is
    # also left in /tmp for a later call on the same warm machine (r5-serve)
    TAIL=4 stage tune-int4-row1 "${TUNE4_TIME:-200}" bench kernels --tune "$table" --quant int4 \
        --rows 1 --models "${MODELS4:-bloom-7b1,bloom-176b:8,bloom-176b}" \
        --out "$RES/tune-int4-row1.json"
    TAIL=4 stage tune-int8-tiled "${TUNE8_TIME:-200}" bench kernels --tune "$table" --quant int8 \
        --rows 128,256,576 --out "$RES/tune-int8-tiled.json"
    cp "$table" "$RES/"; cp "$table" /tmp/r5-table.json
    TAIL=60 stage kernels "${KERNEL_TIME:-90}" bench kernels --rows 1,16,64,128,256,576 \
        --quant int8,int4 --models bloom-7b1,bloom-176b:8 --out "$RES/kernels.json"
    TAIL=15 stage gpu-tests-kernels "$(left)" gpu_tests -k "linear or family" ;;
r5-serve)  # round 5: int4 decode (7b1, and BLOOM-176B whole on one GPU), then the budget servers
    [ -f /tmp/r5-table.json ] && cp /tmp/r5-table.json "$table" && echo "table from r5-kernels"
    TAIL=25 stage int4-7b1 "${INT4_TIME:-100}" bench gpu --shape bloom-7b1 --quant int4 \
        --out "$RES/int4-7b1.json"
    [ "${INT4_176B_TIME:-150}" -gt 0 ] && TAIL=25 stage int4-176b "${INT4_176B_TIME:-150}" \
        bench gpu --shape bloom-176b --rows mpinfer-int4 --batches 1,8 --out "$RES/int4-176b.json"
    TAIL=30 stage budget "$(left)" bench budget --workdir /tmp/mb --seconds "${SUSTAIN:-20}" \
        --budgets "${BUDGETS:-6GiB,6GiB-twin,24GiB}" --out "$RES/budget.json" ;;
r6-h200)
    TAIL=4 stage tune-int4-row1 "${TUNE4_TIME:-150}" bench kernels --tune "$table" --quant int4 \
        --rows 1 --models "${MODELS4:-bloom-7b1,bloom-176b:8,bloom-176b}" \
        --out "$RES/tune-int4-row1.json"
    cp "$table" "$RES/"
    TAIL=25 stage int4-7b1 "${INT4_TIME:-100}" bench gpu --shape bloom-7b1 --quant int4 \
        --out "$RES/int4-7b1.json"
    TAIL=25 stage int4-176b "${INT4_176B_TIME:-170}" bench gpu --shape bloom-176b \
        --rows mpinfer-int4 --batches 1,8 --out "$RES/int4-176b.json" ;;
r6-offload)
    TAIL=30 stage budget "$(left)" bench budget --workdir /tmp/mb --seconds "${SUSTAIN:-20}" \
        --budgets "${BUDGETS:-6GiB,6GiB-twin}" \
        --offload-seconds "${OFFLOAD_SECONDS:-60}" --out "$RES/budget-offload.json" ;;
int4-row1)  # the one-row int4 loop: re-tune it, the one- and 16-row table, every family's test
    TAIL=4 stage tune-int4-row1 "${TUNE_TIME:-200}" bench kernels --tune "$table" --quant int4 \
        --rows 1 --bf16-rows 1 --out "$RES/tune-int4-row1.json"
    cp "$table" "$RES/"
    TAIL=30 stage kernels-row1 60 bench kernels --rows 1,16 --quant int8,int4 \
        --models bloom-7b1,bloom-176b:8 --out "$RES/kernels-row1.json"
    TAIL=15 stage gpu-tests-family 150 gpu_tests -k "family" ;;
kernels)  # the matmul table, then the kernels' GPU tests
    TAIL=60 stage kernels "${KERNEL_TIME:-90}" bench kernels --rows 1,16,64,128,256,576 \
        --quant int8,int4 --models bloom-7b1,bloom-176b:8 --out "$RES/kernels.json" ;;
candidates)  # other libraries' kernels beside ours, on two bloom-7b1 shapes
    TAIL=30 stage candidates "${CAND_TIME:-150}" bench kernels --rows 1,64,256 \
        --quant int8,int4 --candidates all --models bloom-7b1 --shapes "7b1 qkv,7b1 fc2" \
        --out "$RES/candidates.json" ;;
tune8-decode)  # int8 launches of 1-64 rows and the 512-row bucket (the H100 had no entries)
    TAIL=4 stage tune-int8-decode "${TUNE8_TIME:-300}" bench kernels --tune "$table" --quant int8 \
        --rows "${ROWS8:-1,16,32,64,512}" --models "${MODELS8:-bloom-7b1,bloom-176b:8}" \
        --out "$RES/tune-int8-decode.json"
    cp "$table" "$RES/" ;;
mixed-profile)  # where a served mixed step's time goes (the engine in-process, unique mix)
    TAIL=60 stage "mixed-profile${PROFILE_ARGS:+-kv8}" "${PROFILE_TIME:-300}" \
        python3 -m mpinfer.tools.diag.mixed_step \
        --seconds "${SUSTAIN:-20}" --prefill "${PREFILL:-512}" ${PROFILE_ARGS:-} \
        --out "$RES/mixed-profile${PROFILE_ARGS:+-kv8}.json" ;;
dequant-ab)  # the served mix with steps past 256 rows dequantizing (shipped) or in registers
    for rows in 0 1024; do
        TAIL=9 stage "dequant-ab-$rows" 150 python3 -m mpinfer.tools.diag.mixed_step --quick \
            --seconds "${SUSTAIN:-20}" --prefill "${PREFILL:-512}" --dequant-rows $rows \
            --out "$RES/dequant-ab-$rows.json"
    done ;;
r8-kernels)
    TAIL=4 stage tune-int8-tiled "${TUNE8_TIME:-260}" bench kernels --tune "$table" --quant int8 \
        --rows 128,256,512 --models "${MODELS8:-bloom-7b1}" --out "$RES/tune-int8-tiled.json"
    cp "$table" "$RES/"
    TAIL=70 stage kernels "${KERNEL_TIME:-100}" bench kernels --rows 1,16,64,128,256,512,576 \
        --quant int8 --models bloom-7b1,bloom-176b:8 --out "$RES/kernels.json"
    TAIL=15 stage gpu-tests-family "$(left)" gpu_tests -k "family or int8_linear" ;;
r9-h200)  # round 9, on an H200: BLOOM-176B int4 whole on the GPU, 7b1 int4 beside int8, then
    # the tiled int8 launches re-tuned with magic6 (the table is also left in /tmp for a next call)
    TAIL=25 stage int4-176b "${INT4_176B_TIME:-215}" bench gpu --shape bloom-176b \
        --rows mpinfer-int4 --batches 1,8 --out "$RES/int4-176b.json"
    TAIL=25 stage int4-7b1 "${INT4_TIME:-100}" bench gpu --shape bloom-7b1 --quant int4 \
        --out "$RES/int4-7b1.json"
    TAIL=4 stage tune-int8-tiled "$(left)" bench kernels --tune "$table" --quant int8 \
        --rows 128,256,512 --models "${MODELS8:-bloom-7b1}" --out "$RES/tune-int8-tiled.json"
    cp "$table" "$RES/"; cp "$table" /tmp/r9-table.json ;;
r9-kernels)  # round 9: the tiled int8 launches re-tuned, bloom-7b1 at 128-512 rows and the 176B
    # tp-8 rank at 128 and 256 (its config's steps stop at 256), then the matmul table; the
    # table is also left in /tmp for a next call
    TAIL=4 stage tune-7b1 "${TUNE8_TIME:-120}" bench kernels --tune "$table" --quant int8 \
        --rows 128,256,512 --models bloom-7b1 --out "$RES/tune-7b1.json"
    TAIL=4 stage tune-176b8 "${TUNE176_TIME:-100}" bench kernels --tune "$table" --quant int8 \
        --rows 128,256 --models bloom-176b:8 --out "$RES/tune-176b8.json"
    cp "$table" "$RES/"; cp "$table" /tmp/r9-table.json
    TAIL=70 stage kernels "${KERNEL_TIME:-100}" bench kernels --rows 1,16,64,128,256,512,576 \
        --quant int8 --models bloom-7b1,bloom-176b:8 --out "$RES/kernels.json" ;;
r9-serve)  # on the machine r9-kernels left warm: its table, the kernels' GPU tests, then the
    # served unique mix at 32 clients (the budget bench's one-phase server; BUDGET_ENV: an
    # environment variable for the server, e.g. an A/B of a knob)
    [ -f /tmp/r9-table.json ] && cp /tmp/r9-table.json "$table" && echo "table from r9-kernels"
    TAIL=15 stage gpu-tests-family "${TEST_TIME:-150}" gpu_tests -k "family or int8_linear"
    TAIL=6 stage served-u32 150 bench budget --workdir /tmp/mb --budgets 24GiB-u32 \
        --seconds "${SUSTAIN:-20}" ${BUDGET_ENV:+--env "$BUDGET_ENV"} --out "$RES/served-u32.json" ;;
r9-kv)  # the decode attention over fp16 and int8 caches (this tree's kernels and KV_OLD's, a copy
    # of an older attention.py beside it), the attention GPU tests, the unique mix in-process
    # with each cache
    TAIL=40 stage kv-attention 150 python3 -m mpinfer.tools.diag.kv_attention \
        --modules "attention${KV_OLD:+,$KV_OLD}" --out "$RES/kv-attention.json"
    TAIL=8 stage gpu-tests-attention "${TEST_TIME:-150}" gpu_tests -k "flat_step or fused_decode"
    for kv in ${KV_MIX:-fp16 int8}; do
        TAIL=9 stage "mix-kv-$kv" 140 python3 -m mpinfer.tools.diag.mixed_step --quick \
            --seconds "${SUSTAIN:-20}" $([ $kv = int8 ] && echo --kv-int8) \
            --out "$RES/mix-kv-$kv.json"
    done ;;
r10-sampler)
    TAIL=12 stage sampler-cost 90 python3 -m mpinfer.tools.diag.sampler_cost \
        --out "$RES/sampler-cost.json"
    for arm in "sample-one-scan --sample --one-scan-draw" "sample --sample" "greedy"; do
        read -ra args <<< "$arm"
        TAIL=9 stage "mix-${args[0]}" "${MIX_TIME:-140}" python3 -m mpinfer.tools.diag.mixed_step \
            --quick --seconds "${SUSTAIN:-20}" "${args[@]:1}" --out "$RES/mix-${args[0]}.json"
    done
    TAIL=6 stage served-u32 "$(left)" bench budget --workdir /tmp/mb --budgets 24GiB-u32 \
        --seconds "${SUSTAIN:-20}" --out "$RES/served-u32.json" ;;
r11-int4)  # round 11: the int4 families' GPU tests (magic7 among them), the one- and 16-row int4
    # launches re-tuned (MODELS4), bloom-7b1 int4 beside int8, BLOOM-176B int4 where it fits
    TAIL=4 stage gpu-tests-int4 "${TEST_TIME:-150}" gpu_tests -k "every_config_family and 4"
    TAIL=20 stage tune-int4 "${TUNE4_TIME:-240}" bench kernels --tune "$table" --quant int4 \
        --rows 1,16 --models "${MODELS4:-bloom-7b1,bloom-176b}" --out "$RES/tune-int4.json"
    cp "$table" "$RES/"
    TAIL=25 stage int4-7b1 "${INT4_TIME:-80}" bench gpu --shape bloom-7b1 --quant int4 \
        --out "$RES/int4-7b1.json"
    if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)" -gt 120000 ]; then
        TAIL=25 stage int4-176b "${INT4_176B_TIME:-110}" bench gpu --shape bloom-176b \
            --rows mpinfer-int4 --batches 1,8 --out "$RES/int4-176b.json"
    fi ;;
r12-int4-ab)  # the shipped table against the same re-tuned at 16 rows (magic7 in the sweep), on
    # one machine, alternating: bloom-7b1 int4 decode at 1 and 8, BLOOM-176B where it fits
    cp "$table" /tmp/base.json
    TAIL=4 stage tune-int4-16 "${TUNE4_TIME:-150}" bench kernels --tune "$table" --quant int4 \
        --rows 16 --models "${MODELS4:-bloom-7b1,bloom-176b}" --out "$RES/tune-int4-16.json"
    cp "$table" /tmp/tuned.json; cp "$table" "$RES/"
    big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)
    i=0
    for arm in base tuned base tuned; do
        i=$((i + 1)); cp "/tmp/$arm.json" "$table"
        TAIL=4 stage "ab$i-7b1-$arm" 60 bench gpu --shape bloom-7b1 --rows mpinfer-int4 \
            --batches 1,8 --out "$RES/ab$i-7b1-$arm.json"
        [ "$big" -gt 120000 ] && [ $i -le 2 ] && TAIL=4 stage "ab$i-176b-$arm" 110 bench gpu \
            --shape bloom-176b --rows mpinfer-int4 --batches 1,8 --out "$RES/ab$i-176b-$arm.json"
    done
    cp /tmp/base.json "$table" ;;
r12-magic8)  # round 12: int4's one-row loop in packed fp16 (magic8): its GPU family test, the
    # one-row int4 launches re-tuned with it in the sweep (MODELS4), then the shipped table
    # against the re-tuned one on this machine: bloom-7b1 int4 decode, BLOOM-176B where it fits
    cp "$table" /tmp/base.json
    MPINFER_FAMILY_ONLY=magic8,magic9 TAIL=6 stage gpu-tests-magic8 "${TEST_TIME:-80}" gpu_tests \
        -k "every_config_family and dtype0-4"
    TAIL=30 stage tune-int4-1 "${TUNE4_TIME:-170}" bench kernels --tune "$table" --quant int4 \
        --rows 1 --models "${MODELS4:-bloom-7b1,bloom-176b}" --out "$RES/tune-int4-1.json"
    cp "$table" /tmp/tuned.json; cp "$table" "$RES/"
    big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)
    for arm in tuned base; do
        cp "/tmp/$arm.json" "$table"
        TAIL=4 stage "7b1-$arm" 45 bench gpu --shape bloom-7b1 --rows mpinfer-int4 \
            --batches 1,8 --out "$RES/7b1-$arm.json"
        [ "$big" -gt 120000 ] && TAIL=4 stage "176b-$arm" 105 bench gpu --shape bloom-176b \
            --rows mpinfer-int4 --batches 1,8 --out "$RES/176b-$arm.json"
    done
    cp /tmp/tuned.json "$table" ;;
r13-tma)  # round 13: int8's warp-specialized loop (tma configs): its GPU family test, the tiled
    # int8 launches re-tuned with it in the sweep (MODELS8, 128-512 rows), the matmul table
    cp "$table" /tmp/base.json
    MPINFER_FAMILY_ONLY=tma+magic6,tma+magic2 TAIL=6 stage gpu-tests-tma "${TEST_TIME:-80}" gpu_tests \
        -k "every_config_family and dtype0-8"
    TAIL=4 stage tune-int8-tiled "${TUNE8_TIME:-130}" bench kernels --tune "$table" --quant int8 \
        --rows "${ROWS8:-128,256,512}" --models "${MODELS8:-bloom-7b1}" \
        --out "$RES/tune-int8-tiled.json"
    cp "$table" "$RES/"; cp "$table" /tmp/r13-table.json
    TAIL=40 stage kernels "${KERNEL_TIME:-100}" bench kernels --rows "${ROWS_K:-64,128,256,512,576}" \
        --quant int8 --models "${MODELS_K:-bloom-7b1,bloom-176b:8}" --out "$RES/kernels.json" ;;
r13-mix)  # after r13-tma on the same machine: the unique mix in-process (32 clients, closed
    # loop), the shipped table (its dequantizing crossover) against r13-tma's (nothing dequantized
    # up to 512 rows), alternating
    for arm in base tuned base tuned; do
        [ "$arm" = base ] && cp /tmp/base.json "$table" && extra=() || \
            { cp /tmp/r13-table.json "$table"; extra=(--dequant-rows 1024); }
        TAIL=6 stage "mix-$arm-$SECONDS" "${MIX_TIME:-110}" python3 -m mpinfer.tools.diag.mixed_step \
            --quick --seconds "${SUSTAIN:-15}" "${extra[@]}" --out "$RES/mix-$arm-$SECONDS.json"
    done
    cp /tmp/r13-table.json "$table" ;;
r15-fewrow)  # round 15: the warp-specialized loop over one tile of 17-64 rows: the tma family
    # test, the 32- and 64-row int8 launches re-tuned with it in the sweep (MODELS8), the matmul
    # table at 16-128 rows, then the unique mix in-process, shipped table against re-tuned,
    # alternating (the re-tuned table is left in $RES and /tmp for a served A/B)
    cp "$table" /tmp/base.json
    MPINFER_FAMILY_ONLY=tma TAIL=6 stage gpu-tests-tma "${TEST_TIME:-80}" gpu_tests \
        -k "every_config_family and dtype0-8"
    TAIL=12 stage tune-fewrow "${TUNE8_TIME:-150}" bench kernels --tune "$table" --quant int8 \
        --rows 32,64 --models "${MODELS8:-bloom-7b1,bloom-176b:8}" --out "$RES/tune-fewrow.json"
    cp "$table" "$RES/fewrow-table.json"; cp "$table" /tmp/r15-table.json
    TAIL=40 stage kernels "${KERNEL_TIME:-80}" bench kernels --rows 16,32,64,128 --quant int8 \
        --models "${MODELS_K:-bloom-7b1,bloom-176b:8}" --out "$RES/kernels.json"
    for arm in base tuned base tuned; do
        cp "/tmp/$([ $arm = base ] && echo base || echo r15-table).json" "$table"
        TAIL=6 stage "mix-$arm-$SECONDS" "${MIX_TIME:-60}" python3 -m mpinfer.tools.diag.mixed_step \
            --quick --seconds "${SUSTAIN:-12}" --out "$RES/mix-$arm-$SECONDS.json"
    done
    cp /tmp/r15-table.json "$table"; cp /tmp/r15-table.json /tmp/r9-table.json ;;
r16-attn)  # round 16: the decode attention over the unique mix's mixed histories at every split
    # count (kv_attention --mixed), the unique mix in-process with the policy before round 16
    # (MPINFER_ATTN_MIN_SPLITS=1) against the shipped one (8), alternating, the GPU budget tests
    TAIL=20 stage attn-mixed "${ATTN_TIME:-120}" python3 -m mpinfer.tools.diag.kv_attention \
        --mixed --out "$RES/attn-mixed.json"
    for arm in 1 8 1 8; do
        TAIL=3 stage "mix-split$arm-$SECONDS" "${MIX_TIME:-70}" env MPINFER_ATTN_MIN_SPLITS=$arm \
            python3 -m mpinfer.tools.diag.mixed_step --quick --seconds "${SUSTAIN:-10}" \
            --out "$RES/mix-split$arm-$SECONDS.json"
    done
    TAIL=8 stage gpu-tests-budget "${TEST_TIME:-200}" pytest_gpu tests/test_gpu_engine.py -k budget ;;
r17-int4-read)  # is the one-row int4 loop's gap to a plain read its access pattern or its
    # arithmetic: the packed weights read contiguously, as the loop's tiles walk them, and by the
    # W4A16 launch (bloom-7b1, BLOOM-176B on one GPU); then Nsight Compute on BLOOM-176B's qkv
    # (READ_CONFIGS: other one-row configs beside the table's, "split{}" for their splits)
    TAIL=40 stage int4-read "${READ_TIME:-120}" python3 -m mpinfer.tools.diag.access_pattern \
        --int4 ${READ_CONFIGS:+--configs "$READ_CONFIGS"}
    # (NCU_CONFIG: the config profiled; default this GPU's table's)
    cfg=${NCU_CONFIG:-$(python3 -c "import torch; from mpinfer.model.kernels import tuning; print(
        tuning.lookup(torch.cuda.get_device_name(), 'float16', 1, 43008, 14336, bits=4, group=128)
        or 'fma n64 k128 split3 pf1 magic9 w2 s3')")}
    TAIL=${NCU_TAIL:-70} stage ncu-176b-qkv "${NCU_TIME:-90}" ncu --profile-from-start off \
        --clock-control none -k "regex:_w4a16" --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy python3 -m \
        mpinfer.tools.diag.matmul_profile --shape 43008x14336 --rows 1 --bits 4 --no-cublas "$cfg" ;;
step-cap)  # #44's ITL p99 against TTFT p99: the unique mix in-process with steps capped at
    # CAPS tokens (server.max_step_tokens; default 256, 384, 512), twice each, alternating, then
    # the decode step at batch 32 and context 128 (3 x it is #44's ITL p99 target)
    for round in 1 2; do
        for cap in ${CAPS:-256 384 512}; do
            TAIL=9 stage "mix-cap$cap-$round" "${MIX_TIME:-100}" python3 -m \
                mpinfer.tools.diag.mixed_step --quick --seconds "${SUSTAIN:-12}" \
                --step-tokens "$cap" --out "$RES/mix-cap$cap-$round.json"
        done
    done
    step_b32 ;;
step-cap-served)  # the same trade served: `mpinfer serve` (the 24 GiB server, 64 slots) under the
    # unique mix at 32 HTTP clients, per arm of SERVED_ARMS (';'-separated lists of `--set`
    # keys and of MPINFER_* switches for that arm's server), then the batch-32 context-128 step
    IFS=';' read -ra arms <<< "${SERVED_ARMS:-max_step_tokens=256 kv_cache_dtype=int8;\
max_step_tokens=512;max_step_tokens=256}"
    for i in "${!arms[@]}"; do
        sets=(); envs=()
        for kv in ${arms[$i]}; do
            case $kv in MPINFER_*) envs+=("$kv") ;; *) sets+=(--set "server.$kv") ;; esac
        done
        echo "arm $i: ${arms[$i]}"
        TAIL=6 stage "served-arm$i" "${ARM_TIME:-150}" env "${envs[@]}" python3 -m mpinfer.cli \
            bench budget --workdir /tmp/mb --budgets 24GiB-u32 --seconds "${SUSTAIN:-20}" \
            "${sets[@]}" --out "$RES/served-arm$i.json"
    done
    step_b32 ;;
ab-old)  # this tree against an older one's code, same table, alternating on one machine: decode
    # steps (bloom-7b1 int8 and int4) and the unique mix in-process. The older tree: carried in
    # .ab/old (ignored by git), e.g. `mkdir -p .ab/old && git archive COMMIT mpinfer | tar -x -C
    # .ab/old`; `carry` names .ab
    [ -d .ab/old/mpinfer ] || { echo "ab-old: no .ab/old/mpinfer (carry .ab)"; exit 2; }
    cp "$table" ".ab/old/$table"
    for arm in old new old new; do
        dir=$([ $arm = old ] && echo "$PWD/.ab/old" || echo "$PWD")
        TAIL=4 stage "decode-$arm-$SECONDS" 60 env PYTHONPATH="/tmp/site:$dir" python3 -m \
            mpinfer.cli bench gpu --shape bloom-7b1 --rows mpinfer-int8,mpinfer-int4 \
            --batches 1,8,32 --out "$RES/decode-$arm-$SECONDS.json"
        TAIL=3 stage "mix-$arm-$SECONDS" "${MIX_TIME:-60}" env PYTHONPATH="/tmp/site:$dir" \
            python3 -m mpinfer.tools.diag.mixed_step --quick --seconds "${SUSTAIN:-12}" \
            --out "$RES/mix-$arm-$SECONDS.json"
    done ;;
r18-kv8)  # the int8 cache's decode attention (its loop is bound by its instructions: round 9):
    # the shipped (biased) route, the exact loop and 64-key tiles (MPINFER_KV8_BIASED,
    # MPINFER_KV8_TILE_KEYS; KV_MODULES: the variants) over both caches, the attention GPU tests,
    # then the unique mix in-process with the int8 cache at a 256-token cap (round 18's ITL
    # trade) per arm of KV8_ARMS, alternating: exact (MPINFER_KV8_BIASED=0), shipped, new (the
    # switches in KV8_ARM)
    TAIL=60 stage kv8 "${KV_TIME:-200}" python3 -m mpinfer.tools.diag.kv_attention --modules \
        "${KV_MODULES:-attention,attention:exact,attention:l64,attention:l64:exact}" \
        --out "$RES/kv8.json"
    TAIL=8 stage gpu-tests-attention "${TEST_TIME:-100}" gpu_tests -k "flat_step or fused_decode"
    for arm in ${KV8_ARMS:-exact shipped exact shipped}; do
        case $arm in
            exact) env=MPINFER_KV8_BIASED=0 ;;
            new) env=${KV8_ARM:?KV8_ARM: switches of the new arm, e.g. MPINFER_KV8_TILE_KEYS=64} ;;
            *) env= ;;
        esac
        TAIL=3 stage "mix-kv8-$arm-$SECONDS" "${MIX_TIME:-100}" env $env python3 -m \
            mpinfer.tools.diag.mixed_step --quick --seconds "${SUSTAIN:-12}" --kv-int8 \
            --step-tokens 256 --out "$RES/mix-kv8-$arm-$SECONDS.json"
    done ;;
rank-fit)  # the headline config's one card on one GPU: rank 0 of BLOOM-176B at tp 8 (random
    # weights in place, collectives skipped) started as `mpinfer serve` starts it under the
    # config's 24,564 MiB, stage by stage against the plan, then a burst's NVML peak; int8, int4
    for c in ${RANK_CONFIGS:-bloom-176b-8x24gb bloom-176b-8x24gb-int4}; do
        TAIL=30 stage "rank-fit-$c" "${RANK_TIME:-200}" python3 -m \
            mpinfer.tools.diag.startup_memory bloom-176b 24564MiB --simulate-tp 8 \
            --config "configs/$c.toml" --out "$RES/rank-fit-$c.json"
    done ;;
r21-int4-lines)  # the one-row int4 loop (magic8/9) loading whole 128-byte lines of 4 rows
    # (w4a16.LINES) against half lines of 8 (shipped): the launches and parts of their work left
    # out (round 21: the loads alone take as long as the whole loop), Nsight Compute on
    # BLOOM-176B's qkv beside a plain tiled read, the one-row launches re-tuned with whole lines,
    # the family test, then decode steps: shipped table and loads against re-tuned and lines
    TAIL=60 stage int4-ablate "${ABLATE_TIME:-200}" python3 -m mpinfer.tools.diag.access_pattern \
        --int4 --ablate
    # whole lines in other tilings than the table's (the best of splits 2, 3, 4 and 6 each)
    # (a default with braces inside ${VAR:-...} would end at its first brace)
    lconf="fma n64 k128 split{} pf1 magic8 w4 s3;fma n32 k128 split{} pf1 magic8 w2 s3"
    lconf="$lconf;fma n128 k128 split{} pf1 magic8 w8 s3"
    [ "${LCONF_TIME:-90}" -gt 0 ] && TAIL=40 stage int4-lines-configs "${LCONF_TIME:-90}" env \
        MPINFER_INT4_LINES=1 python3 -m mpinfer.tools.diag.access_pattern --int4 --configs \
        "${LINE_CONFIGS:-$lconf}"
    cfg=$(python3 -c "import torch; from mpinfer.model.kernels import tuning; print(
        tuning.lookup(torch.cuda.get_device_name(), 'float16', 1, 43008, 14336, bits=4, group=128)
        or 'fma n64 k128 split3 pf1 magic9 w2 s3')")
    [ "${NCU_TIME:-100}" -gt 0 ] && TAIL=${NCU_TAIL:-8} stage ncu-176b-qkv "${NCU_TIME:-100}" ncu \
        --profile-from-start off --clock-control none -k "regex:_w4a16|read_tiles" \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy python3 -m \
        mpinfer.tools.diag.matmul_profile --shape 43008x14336 --rows 1 --bits 4 --no-cublas \
        --lines --read "n32 k256 split6" "$cfg"
    cp "$table" /tmp/table-shipped.json
    TAIL=12 stage tune-int4-lines "${TUNE4_TIME:-200}" env MPINFER_INT4_LINES=1 python3 -m \
        mpinfer.cli bench kernels --tune "$table" --quant int4 --rows 1 \
        --models "${MODELS4:-bloom-7b1,bloom-176b}" --out "$RES/tune-int4-lines.json"
    cp "$table" /tmp/table-lines.json; cp "$table" "$RES/table-lines.json"
    TAIL=8 stage gpu-tests-lines "${TEST_TIME:-100}" env MPINFER_INT4_LINES=1 \
        MPINFER_FAMILY_ONLY=magic8,magic9 bash -c 'gpu_tests -k "every_config_family and dtype0-4"'
    ;&
r21-int4-ab)  # after r21-int4-lines on the same machine (its tables in /tmp): decode steps,
    # the shipped table and loads against the re-tuned table and whole lines, alternating
    big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)
    for arm in ${ARMS:-shipped lines shipped lines}; do
        cp "/tmp/table-$arm.json" "$table"
        lines=$([ "$arm" = lines ] && echo 1 || echo 0)
        TAIL=6 stage "int4-7b1-$arm-$SECONDS" "${INT4_TIME:-70}" env MPINFER_INT4_LINES=$lines \
            python3 -m mpinfer.cli bench gpu --shape bloom-7b1 --rows mpinfer-int4 --batches 1,8 \
            --context 128 --out "$RES/int4-7b1-$arm-$SECONDS.json"
        [ "$big" -gt 120000 ] && TAIL=6 stage "int4-176b-$arm-$SECONDS" "${INT4_176B_TIME:-150}" \
            env MPINFER_INT4_LINES=$lines python3 -m mpinfer.cli bench gpu --shape bloom-176b \
            --rows mpinfer-int4 --batches 1,8 --out "$RES/int4-176b-$arm-$SECONDS.json"
    done
    cp /tmp/table-lines.json "$table" ;;
ncu)  # Nsight Compute's counters of single launches (NCU_RUNS: ';'-separated argument lists of
    # diag.matmul_profile: shape, rows, bits, configs)
    IFS=';' read -ra runs <<< "${NCU_RUNS:?NCU_RUNS: e.g. --shape 12288x4096 --rows 512 CONFIG}"
    for i in "${!runs[@]}"; do
        eval "args=(${runs[$i]})"
        TAIL=${NCU_TAIL:-60} stage "ncu-$i" "${NCU_TIME:-90}" ncu --profile-from-start off \
            --clock-control none -k "regex:_w4a16|_w8a16|gemm|gemv|sm90|cutlass" \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
            --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
            python3 -m mpinfer.tools.diag.matmul_profile "${args[@]}"
    done ;;
r8-mix)
    for arm in "shipped7 --step-tokens 0 --dequant-rows 256" "capped --step-tokens 512"; do
        read -ra args <<< "$arm"
        TAIL=9 stage "mix-${args[0]}" 150 python3 -m mpinfer.tools.diag.mixed_step --quick \
            --seconds "${SUSTAIN:-20}" "${args[@]:1}" --out "$RES/mix-${args[0]}.json"
    done
    TAIL=30 stage budget "$(left)" bench budget --workdir /tmp/mb --budgets 24GiB \
        --seconds "${SUSTAIN:-20}" --out "$RES/budget.json" ;;
kernel-tests) TAIL=15 stage gpu-tests-kernels "$(left)" gpu_tests -k "${TESTS_K:-linear or family}" ;;
tests)  # the engine's and server's tests first (a few minutes), then the kernels' (227 tests:
    # more than one call's 10 minutes on an H100; TESTS_K narrows them)
    TAIL=15 stage gpu-tests-engine "${TEST_TIME:-300}" pytest_gpu tests/test_gpu_engine.py
    TAIL=15 stage gpu-tests-kernels "$(left)" pytest_gpu tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} ;;
serve)
    TAIL=40 stage serve 300 bench serve --gpu --workdir /tmp/mb --out "$RES/serve-gpu.json" ;;
budget)
    TAIL=30 stage budget "${BUDGET_TIME:-330}" bench budget --workdir /tmp/mb \
        --budgets "${BUDGETS:-24GiB,12GiB,6GiB,6GiB-twin,int4}" --seconds "${SUSTAIN:-25}" \
        --out "$RES/budget.json" ;;
tune4)
    rows=1,16,32,64,128,256,512,576
    TAIL=4 stage tune-int4 120 bench kernels --tune "$table" --quant int4 --rows $rows \
        --bf16-rows $rows --out "$RES/tune-int4.json"
    cp "$table" "$RES/" ;;
int4)
    TAIL=25 stage int4-7b1 "${INT4_TIME:-100}" bench gpu --shape bloom-7b1 --quant int4 \
        --out "$RES/int4-7b1.json" ;;
int4-176b)
    TAIL=25 stage int4-176b "${INT4_176B_TIME:-150}" bench gpu --shape bloom-176b \
        --rows mpinfer-int4 --batches 1,8 --out "$RES/int4-176b.json" ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac; done
pack
echo "done at ${SECONDS}s"
