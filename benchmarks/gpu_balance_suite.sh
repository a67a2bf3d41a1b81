#!/usr/bin/env bash
# The decode-balancing placement on two GPUs (one call, < 9.5 min; carry .whl): chat-like goodput, colocated x2
# against the adaptive 1P1D (PD + skip-P + P-alone with balance) at the same seeded arrivals, 24 s windows, RATES
# around colocated's loose threshold; then the Qwen3.5-MoE CUDA tests on GPU 0 (GPU_TESTS, when time is left).
set -uo pipefail
START=$(date +%s); OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
DL=${DEADLINE_S:-420}
timeout $((DL + 45)) python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --preset nemotron-h-8b \
  --workloads "${WORKLOAD:-chat}" --gpus 0,1 --configs "${CONFIGS:-colocated,adaptive}" --rates "${RATES:-10,12,14}" \
  --duration "${DURATION:-24}" --drain 8 --warmup-requests 16 --low-load 3 --deadline-s "$DL" \
  --out-dir "$OUT/balance" > "$OUT/balance.log" 2>&1
echo "goodput: exit $? ($(( $(date +%s) - START )) s)"
grep -iE "placements|prefill_alone|fast path" "$OUT/balance.log" | tail -8
rm -f "$OUT"/balance/*.png.tmp
LEFT=$(( ${TOTAL_S:-570} - ($(date +%s) - START) ))
if [ -n "${GPU_TESTS:-}" ] && [ "$LEFT" -gt 60 ]; then
  timeout $((LEFT - 10)) python3 -m pytest -q -p no:cacheprovider -x $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $? ($(( $(date +%s) - START )) s)"; tail -5 "$OUT/gpu_tests.log"
fi
python3 -m benchmarks.goodput_report "$OUT"/balance/goodput.json || tail -30 "$OUT/balance.log"
