#!/usr/bin/env bash
# One 2-GPU call (< 9 min; carry .whl, and BEFORE if set):
#   1. at once: Nemotron-3-Nano-30B-A3B served by one colocated worker on GPU 0 with the memory share an 80 GB card
#      gives at --gpu-memory-utilization 0.92 (on a larger card the utilization is scaled down to that share), and
#      on GPU 1 the Nemotron-H-8B decode step (batch 64, context 1k, CUDA graphs) of this tree, interleaved with
#      that of an older checkout in $BEFORE (a directory; optional), two rounds each;
#   2. goodput, Nemotron-H-8B preset, chat-like workload (WORKLOAD), --max-num-seqs 32 (the decode worker saturates
#      within the sweep, where the adaptive placement sends whole requests to the prefill worker): 2 colocated
#      replicas vs 1P1D vs adaptive on both GPUs, with the low-load handoff phases and the placements per rate.
set -uo pipefail
START=$(date +%s); OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"
source benchmarks/gpu_env.sh
SITE=$PYTHONPATH
TOTAL_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print $1 / 1024}')
UTIL=$(python3 -c "print(min(0.92, round(0.92 * 79.65 / $TOTAL_GIB, 3)))")
echo "GPU 0: $TOTAL_GIB GiB; 30B at --gpu-memory-utilization $UTIL (= 0.92 of an 80 GB H100's 79.65 GiB)"
timeout 260 python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --drain 10 --deadline-s 200 \
  --out-dir "$OUT/serve_30b_80gb" --preset nemotron-3-nano-30b-a3b --workloads long --gpus 0 --configs colocated \
  --rates 0.5 --duration 8 --warmup-requests 4 --low-load 2 --max-num-seqs 64 --gpu-memory-utilization "$UTIL" \
  > "$OUT/serve_30b_80gb.log" 2>&1 &
SERVE=$!
step() {  # label, tree directory
  (cd "$2" && for d in engine prefill decode kvtransfer proto proxy deploy worker; do ln -sfn "../$d" "hybridpd/$d"; done
   CUDA_VISIBLE_DEVICES=1 PYTHONPATH="$PWD:${SITE#*:}" timeout 150 python3 benchmarks/roofline.py \
     --presets nemotron-h-8b --batches 64 --contexts 1024 --modes graph --prefill-tokens 0 --steps 20 \
     --out "$OUT/step_$1.json" > "$OUT/step_$1.log" 2>&1)
  echo "decode step $1: $(grep -E 'nemotron-h-8b +graph +64 +1024' "$OUT/step_$1.log" | tail -1)"
}
for r in 1 2; do
  step "after_r$r" "$PWD"
  [ -n "${BEFORE:-}" ] && step "before_r$r" "$BEFORE"
done
wait $SERVE; echo "30B serve: exit $?"
grep -E "GPU memory|KV cache plan|does not fit|Error|^(==|  rate)" "$OUT/serve_30b_80gb.log" | cut -c1-400 | tail -8
left=$(( ${SUITE_BUDGET_S:-570} - ($(date +%s) - START) ))
timeout $(( left + 20 )) python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --drain 8 --deadline-s "$left" \
  --out-dir "$OUT/pd" --preset nemotron-h-8b --workloads "${WORKLOAD:-chat}" --gpus 0,1 \
  --configs colocated,1p1d,adaptive --max-num-seqs 32 --rates "${RATES:-4,8,12,16}" --duration 6 \
  --warmup-requests 12 --low-load 3 > "$OUT/pd.log" 2>&1
echo "goodput: exit $?"; grep -E "^(==|  rate)" "$OUT/pd.log" | tail -20
echo; echo "== results ($(( $(date +%s) - START )) s)"
python3 -m benchmarks.goodput_report "$OUT"/pd/goodput.json "$OUT"/serve_30b_80gb/goodput.json | cut -c1-600
