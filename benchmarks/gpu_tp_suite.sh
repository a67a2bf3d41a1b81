#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU box (plain processes, NCCL, no Ray), one call (< 9 min). Carry .whl (gpu_env.sh).
#   1. the 8B decode step (batch 64, graphs) at TP 1 and TP 2, one all-reduce also timed alone inside a CUDA graph;
#   2. PD between TP sizes over NIXL through worker processes (P TP 2 -> D TP 1, P TP 1 -> D TP 2, fp32 NemotronH):
#      tokens == colocated TP 1, and how many prompts were handed off rather than recomputed;
#   3. Nemotron-3-Nano-30B-A3B served at TP 2 (one colocated worker on both GPUs, bf16, random weights).
# `gpu_tp_suite.sh identity`: instead, the fp32 TP 2 == TP 1 greedy-token check through LLM, and the engine-level
# hetero handoffs (benchmarks/tp_decode.py --identity). Results (JSON, logs) under ${OUT:-out}.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
if [[ "${1:-}" == "identity" ]]; then
  timeout 540 python3 benchmarks/tp_decode.py --jobs "" --identity --out "$OUT/tp_identity.json" 2>&1 | tail -30
  exit "${PIPESTATUS[0]}"
fi
timeout 220 python3 benchmarks/tp_decode.py --jobs "${TP_JOBS:-nemotron-h-8b:1,nemotron-h-8b:2,nemotron-3-nano-30b-a3b:2,nemotron-3-nano-30b-a3b:2:ep}" \
  --modes graph --prefill-tokens 0 --job-timeout 100 --out "$OUT/tp_decode.json" > "$OUT/tp_decode.log" 2>&1
echo "tp_decode: exit $?"; grep -v "^{" "$OUT/tp_decode.log" | grep -v "^\[rank" | tail -12
timeout 160 python3 benchmarks/tp_pd_nixl.py --models nemotron_h --out "$OUT/tp_pd_nixl.json" > "$OUT/tp_pd_nixl.log" 2>&1
echo "tp_pd_nixl: exit $?"; grep -E "hetero-TP|Error|error|timed out|Traceback" "$OUT/tp_pd_nixl.log" | head -20
timeout 175 python3 benchmarks/tp_serve.py --preset nemotron-3-nano-30b-a3b --tp 2 --out "$OUT/tp_serve_30b.json" \
  > "$OUT/tp_serve_30b.log" 2>&1
echo "tp_serve 30B: exit $?"; tail -25 "$OUT/tp_serve_30b.log"
