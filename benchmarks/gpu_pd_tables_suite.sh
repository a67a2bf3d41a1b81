#!/usr/bin/env bash
# PD vs colocated beyond the 8B long-prompt table (one 2-GPU call, < 9.5 min; carry .whl): benchmarks/goodput.py on
#   1. Nemotron-H-8B preset, chat-like and prefix-heavy workloads: 2 colocated replicas vs 1P1D vs adaptive;
#   2. Qwen3.5-9B preset, long prompts: 2 colocated replicas vs 1P1D.
# Rates and windows are short to fit the call (6 s per rate); the table and bar checks print last. WORKLOADS, CONFIGS,
# RATES pick the 8B part, QWEN_RATES the Qwen part, QWEN_RESERVE_S what the 8B part leaves it.
set -uo pipefail
START=$(date +%s); OUT=${OUT:-out}; mkdir -p "$OUT"; BUDGET=${SUITE_BUDGET_S:-560}
source benchmarks/gpu_env.sh
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
run() {  # name, deadline seconds, goodput args...
  local name=$1 dl=$2; shift 2
  timeout $((dl + 45)) python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --drain 8 \
    --deadline-s "$dl" --out-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(left) s of the budget left)"; grep -E "^(==|  rate)" "$OUT/$name.log" | tail -30
}
run nemotron_chat_prefix $(( $(left) - ${QWEN_RESERVE_S:-215} )) --preset nemotron-h-8b --workloads "${WORKLOADS:-chat,prefix}" --gpus 0,1 \
  --configs "${CONFIGS:-colocated,1p1d,adaptive}" --rates "${RATES:-2,4,8,12,16}" --duration 6 \
  --warmup-requests 16 --low-load 3
run qwen_long $(( $(left) - 30 )) --preset qwen3.5-9b --workloads long --gpus 0,1 --configs colocated,1p1d \
  --rates "${QWEN_RATES:-1,2,3,4,5}" --duration 6 --warmup-requests 16 --low-load 3
echo; echo "== results ($(( $(date +%s) - START )) s)"
python3 -m benchmarks.goodput_report "$OUT"/*/goodput.json || tail -30 "$OUT"/*.log
