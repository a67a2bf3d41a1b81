#!/usr/bin/env bash
# What the last session's GPU runs left owed, in lanes of two GPUs, one lane per call < 9.5 min (carry .whl and,
# when saved by an earlier run, .triton). LANES picks it (default tp); on a four-GPU machine two lanes run at once,
# each on its own pair: LANES="tp tests" PARALLEL=1.
#   tp       the TP 2 shutdown (NCCL and CUDA graphs) and async tests, then step_pipeline.py at TP 1 and 2 (the TP 2 <= 0.6 x TP 1 bar)
#   tests    the rest of tests/gpu (oracle, PD, poison, fast path, fused kernels, Qwen3.5-MoE)
#   goodput  colocated x2 against the balanced pair on chat (gpu_balance_suite.sh)
#   new      what the last sessions built and no GPU has run yet: the fused TP block end's engine test on Qwen3.5
#            (fla-core compiles first), the tensor-parallel held-out shapes on CUDA (widths TP does not divide,
#            one KV head / Mamba group / GDN key head under TP; the grouped-MoE 8-alignment guard), fp32 and bf16
# Each lane's log lands in $OUT/<lane>.log; the Triton cache in $OUT/cache.tgz; the summaries print last.
set -uo pipefail
START=$(date +%s); OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
LANES=${LANES:-tp}; LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
lane_tp() {
  timeout $(( $(left) / 3 )) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -o faulthandler_timeout=200 \
    tests/gpu/test_async_scheduling_cuda.py
  echo "tp tests: exit $? ($(( $(date +%s) - START )) s)"
  timeout $(( $(left) - 15 )) python3 benchmarks/step_pipeline.py --preset nemotron-h-8b --device cuda --tp-sizes 1,2 \
    --profile 12 --profile-steps 20 --budget-s $(( $(left) - 30 )) --out "$OUT/step_pipeline.json"
  echo "step_pipeline: exit $? ($(( $(date +%s) - START )) s)"
}
lane_tests() {
  timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=12 \
    -o faulthandler_timeout=$(( $(left) - 20 )) tests/gpu --deselect tests/gpu/test_async_scheduling_cuda.py
  echo "gpu tests: exit $? ($(( $(date +%s) - START )) s)"
}
lane_new() {
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=8 tests/gpu/test_fused_allreduce_cuda.py \
    tests/gpu/test_fast_path_cuda.py -k "fused or moe"
  echo "fused block end and odd-width MoE tests: exit $? ($(( $(date +%s) - START )) s)"
  timeout $(( $(left) - 10 )) python3 -m benchmarks.model_zoo --device cuda --tp 1 2 --only tp_nem_odd tp_nem_kv1 \
    tp_qwen_k1 tp_qmoe_top1 --out "$OUT/model_zoo_tp_cuda.json"
  echo "model_zoo tp shapes: exit $? ($(( $(date +%s) - START )) s)"
}
lane_goodput() { OUT="$OUT/goodput" DEADLINE_S=$(( $(left) - 40 )) bash benchmarks/gpu_balance_suite.sh; }
pids=(); i=0
for lane in $LANES; do
  if [ "${PARALLEL:-0}" = 1 ]; then
    (export CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)); "lane_$lane" > "$OUT/$lane.log" 2>&1) & pids+=($!)
  else
    "lane_$lane" > "$OUT/$lane.log" 2>&1
  fi
  i=$((i + 1))
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
save_triton_cache
for lane in $LANES; do echo "==== $lane"; grep -v '^  File "/\(usr\|opt\)' "$OUT/$lane.log" | tail -40; done
