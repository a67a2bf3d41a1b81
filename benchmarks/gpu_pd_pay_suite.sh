#!/usr/bin/env bash
# One 2-GPU call (< 9 min): does PD pay? benchmarks/goodput.py on the Nemotron-H-8B preset, long-prompt workload,
# 2 colocated replicas (least-loaded) vs 1P1D vs the adaptive policy (the proxy's cache_aware routing: D prefills
# itself when P's queue is long or the remainder short; reported as NOT RUN when the proxy lacks it): the low-load
# check (PD TTFT p50 vs colocated with the handoff phases of P and D, D's TPOT vs its engine's decode step) and
# goodput per GPU at the tight (TTFT<=1 s, TPOT<=25 ms) and loose (TTFT<=2 s, TPOT<=60 ms) SLOs, over rates
# around the knee (1P1D's single prefill GPU saturates near 3-4 req/s of 2k-8k prompts). Then Nemotron-3-Nano-30B-A3B
# on one GPU each, at once: roofline.py on GPU 0 and a serving run (one colocated worker behind the proxy) on GPU 1,
# both with the cache sized from what the weights leave (a model that cannot fit fails at start-up with the
# numbers). Prints the bar checks and one table per run last. Results (JSON) under ${OUT:-out}.
# Carry .whl: nixl, the fastapi stack and fla-core (+ einops) wheels, as for gpu_pd_suite.sh / gpu_fast_path_suite.sh.
#   SUITE_BUDGET_S (default 510): wall-clock budget of the whole script; RATES / DURATION override the sweep;
#   EXTRA=1 adds Qwen3.5-9B and the chat workload when time is left (they do not fit the default budget);
#   CONFIGS (default colocated,1p1d,adaptive), LOW_LOAD (requests of the low-load check), RUN_30B=0 skips the 30B.
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-out}; mkdir -p "$OUT"
BUDGET=${SUITE_BUDGET_S:-510}
source benchmarks/gpu_env.sh
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
run() {  # name, deadline seconds, goodput args...
  local name=$1 dl=$2; shift 2
  timeout $((dl + 60)) python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --drain 10 \
    --deadline-s "$dl" --out-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(left) s of the budget left)"; grep -E "^(==|  rate)" "$OUT/$name.log" | tail -24
}
# 3 configurations x (start, warm-up, 6 requests at low load, 7 rates x 6 s): ~105 s each; rates that would end past
# the deadline are skipped and listed in the JSON (set RATES / DURATION to trade coverage for time)
RESERVE=$([ "${RUN_30B:-1}" = 1 ] && echo 180 || echo 40); CAP=${LONG_CAP_S:-320}
run nemotron_long $(( $(left) - RESERVE > CAP ? CAP : $(left) - RESERVE )) --preset nemotron-h-8b --workloads long \
  --gpus 0,1 --configs "${CONFIGS:-colocated,1p1d,adaptive}" --rates "${RATES:-1,2,2.5,3,3.5,4,5}" \
  --duration "${DURATION:-6}" --warmup-requests 32 --low-load "${LOW_LOAD:-6}"
if [ "${RUN_30B:-1}" = 1 ] && [ "$(left)" -gt 120 ]; then  # Nemotron-3-Nano-30B-A3B: ~59 GiB of bf16 weights, the rest of an 80 GB GPU for cache
  dl=$(( $(left) - 20 > 170 ? 170 : $(left) - 20 ))
  timeout "$dl" env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/roofline.py --presets nemotron-3-nano-30b-a3b \
    --batches 1,64 --contexts 1024,8192 --modes graph --prefill-tokens 4096 --steps 5 \
    --out "$OUT/roofline_30b.json" > "$OUT/roofline_30b.log" 2>&1 &
  ROOF=$!
  run serve_30b $(( dl - 60 )) --preset nemotron-3-nano-30b-a3b --workloads long --gpus 1 --configs colocated \
    --rates 0.5 --duration 6 --warmup-requests 4 --low-load 2 --max-num-seqs 64 --gpu-memory-utilization 0.92
  grep -E "GPU memory|max concurrency|does not fit|Error" "$OUT/serve_30b.log" | tail -4
  wait $ROOF; echo "30B roofline: exit $?"; grep -E '"weights_gib"|nemotron-3' "$OUT/roofline_30b.log" | tail -8
else echo "Nemotron-3-Nano-30B-A3B skipped: $(left) s left"; fi
if [ "${EXTRA:-0}" = 1 ] && [ "$(left)" -gt 200 ]; then
  run qwen_long $(( $(left) - 40 )) --preset qwen3.5-9b --workloads long --gpus 0,1 --configs colocated,1p1d
fi
if [ "${EXTRA:-0}" = 1 ] && [ "$(left)" -gt 200 ]; then
  run nemotron_chat $(( $(left) - 40 )) --preset nemotron-h-8b --workloads chat --gpus 0,1 --configs colocated,1p1d
fi
echo; echo "== results ($(( $(date +%s) - START )) s)"
python3 -m benchmarks.goodput_report "$OUT"/*/goodput.json || tail -30 "$OUT"/*.log
