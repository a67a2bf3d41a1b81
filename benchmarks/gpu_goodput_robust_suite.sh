#!/usr/bin/env bash
# One workload's tight-SLO goodput with long windows (one 2-GPU call, < 9.5 min; carry .whl): colocated x2 vs 1P1D
# on the 8B preset, WORKLOAD (default prefix), RATES around both thresholds, DURATION seconds of arrivals per rate
# (the earlier 6 s windows gave non-monotonic curves). The table and the bar checks print last.
set -uo pipefail
START=$(date +%s); OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
DL=${DEADLINE_S:-530}
timeout $((DL + 45)) python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --preset nemotron-h-8b \
  --workloads "${WORKLOAD:-prefix}" --gpus 0,1 --configs "${CONFIGS:-colocated,1p1d}" --rates "${RATES:-4,6,8,10,12}" \
  --duration "${DURATION:-24}" --drain 8 --warmup-requests 16 --low-load 3 --deadline-s "$DL" \
  --out-dir "$OUT/robust" > "$OUT/robust.log" 2>&1
echo "goodput: exit $? ($(( $(date +%s) - START )) s)"; grep -E "^(==|  rate)" "$OUT/robust.log" | tail -30
rm -f "$OUT"/robust/*.png.tmp
python3 -m benchmarks.goodput_report "$OUT"/robust/goodput.json || tail -30 "$OUT/robust.log"
