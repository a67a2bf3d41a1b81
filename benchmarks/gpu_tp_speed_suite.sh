#!/usr/bin/env bash
# Where the TP 2 decode step goes, and one-GPU serving of the 30B (one 2-GPU call, < 9 min; carry .whl):
#   1. the 8B decode step (batch 64, context 1k) at TP 1 and TP 2 with per-kernel profiles of one step (graph and
#      eager) on rank 0 (benchmarks/tp_decode.py --profile);
#   2. the step's collectives alone inside CUDA graphs under several NCCL settings (benchmarks/allreduce_sweep.py);
#   3. Nemotron-3-Nano-30B-A3B served by one colocated worker on ONE 80 GB GPU behind the proxy (goodput.py,
#      cache sized from what the weights leave), unless RUN_30B=0.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
timeout 240 python3 benchmarks/tp_decode.py --jobs "${TP_JOBS:-nemotron-h-8b:1,nemotron-h-8b:2}" --modes graph,eager \
  --prefill-tokens 0 --profile 22 --job-timeout 110 --out "$OUT/tp_profile.json" > "$OUT/tp_profile.log" 2>&1
echo "tp_decode --profile: exit $?"; grep -v "^{" "$OUT/tp_profile.log" | grep -v "^\[rank" | tail -70
for s in "" "NCCL_PROTO=LL" "NCCL_PROTO=LL128" "NCCL_PROTO=Simple" "NCCL_ALGO=Tree" "NCCL_ALGO=Ring NCCL_PROTO=LL" \
         "NCCL_MIN_NCHANNELS=4 NCCL_MAX_NCHANNELS=4"; do
  env $s timeout 60 python3 benchmarks/allreduce_sweep.py --rows 1,16,64,256 --out "$OUT/allreduce_sweep.jsonl" 2>&1 \
    | grep -E "all-reduce|Error|error" | tail -5
done
if [ "${RUN_30B:-1}" = 1 ]; then
  timeout 230 python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --drain 10 --deadline-s 170 \
    --out-dir "$OUT/serve_30b_1gpu" --preset nemotron-3-nano-30b-a3b --workloads long --gpus 0 --configs colocated \
    --rates 0.5 --duration 8 --warmup-requests 4 --low-load 2 --max-num-seqs 64 --gpu-memory-utilization 0.92 \
    > "$OUT/serve_30b_1gpu.log" 2>&1
  echo "30B on one GPU: exit $?"
  grep -E "GPU memory|max concurrency|does not fit|fast path|Error|^(==|  rate)" "$OUT/serve_30b_1gpu.log" | tail -14
fi
