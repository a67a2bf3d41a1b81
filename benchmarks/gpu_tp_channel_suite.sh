#!/usr/bin/env bash
# The TP control channel on two GPUs (one 2-GPU call, < 9 min; carry .whl). Written 2026-11-27, not yet run:
#   1. rank 0's per-step command to its follower on the GPU host's CPUs, gloo vs the channel (tp_control.py);
#   2. the whole engine's 8B decode step (batch 64, graphs, control path included) at TP 1 and TP 2, and rank 0's
#      send time (tp_control.py --engine): the TP 2 / TP 1 ratio the serving path sees, beside
#   3. tp_decode.py's ranks-in-lockstep step (no control path) at TP 1 and TP 2, the bar's reference figure;
#   4. Nemotron-3-Nano-30B-A3B served at TP 2 behind the proxy (TPOT against its engine step; 28.9 ms at
#      concurrency 16 before the channel), unless RUN_30B=0.
set -uo pipefail
START=$(date +%s); OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
el() { echo "$(( $(date +%s) - START )) s"; }
timeout 60 python3 benchmarks/tp_control.py --out "$OUT/tp_control_gpuhost.json" 2>&1 | tail -14
echo "tp_control messages ($(el))"
timeout 200 python3 benchmarks/tp_control.py --engine nemotron-h-8b --device cuda --tp-sizes 1,2 \
  --out "$OUT/tp_engine_channel.json" > "$OUT/tp_engine_channel.log" 2>&1
echo "tp_control --engine: exit $? ($(el))"; tail -5 "$OUT/tp_engine_channel.log"
timeout 150 python3 benchmarks/tp_decode.py --jobs "nemotron-h-8b:1,nemotron-h-8b:2" --modes graph --prefill-tokens 0 \
  --steps 20 --job-timeout 70 --out "$OUT/tp_decode.json" > "$OUT/tp_decode.log" 2>&1
echo "tp_decode: exit $? ($(el))"; grep -v "^{" "$OUT/tp_decode.log" | grep -v "^\[rank" | tail -5
if [ "${RUN_30B:-1}" = 1 ]; then
  timeout 170 python3 benchmarks/tp_serve.py --preset nemotron-3-nano-30b-a3b --tp 2 --out "$OUT/tp_serve_30b.json" \
    > "$OUT/tp_serve_30b.log" 2>&1
  echo "tp_serve 30B: exit $? ($(el))"; tail -12 "$OUT/tp_serve_30b.log"
fi
