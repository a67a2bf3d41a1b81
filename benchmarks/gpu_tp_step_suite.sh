#!/usr/bin/env bash
# The TP 2 decode step on two GPUs (one 2-GPU call, < 9.5 min; carry .whl): the GEMMs of each rank in both weight
# layouts (gemm_layouts.py, GPU 0), then the control channel's suite without the 30B serving run
# (gpu_tp_channel_suite.sh: messages, the engine's step with the control path, tp_decode.py's step).
set -uo pipefail
START=$(date +%s); OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
timeout 120 python3 benchmarks/gemm_layouts.py --preset nemotron-h-8b --tp-sizes 1,2 --rows 64 \
  --out "$OUT/gemm_layouts.json" > "$OUT/gemm_layouts.log" 2>&1
echo "gemm_layouts: exit $? ($(( $(date +%s) - START )) s)"
WHL=/nonexistent RUN_30B=${RUN_30B:-0} bash benchmarks/gpu_tp_channel_suite.sh
echo "== GEMM layouts"; tail -16 "$OUT/gemm_layouts.log"
