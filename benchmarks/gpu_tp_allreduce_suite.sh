#!/usr/bin/env bash
# The one-shot all-reduce on two GPUs (one 2-GPU call, < 9 min; carry .whl):
#   1. one all-reduce of [rows, 4096] inside a CUDA graph: NCCL vs PyTorch's symmetric-memory one-shot kernel, and
#      one-shot == NCCL bit for bit on a chain of all-reduces (fp32, bf16) (benchmarks/allreduce_sweep.py);
#   2. the 8B decode step (batch 64, context 1k, graphs) at TP 1, TP 2 with NCCL only, TP 2 with the one-shot kernel;
#   3. correctness with the one-shot kernel in the step: heterogeneous-TP PD over NIXL (fp32, tokens == colocated
#      TP 1) and, on GPU 0 at the same time, tests/gpu/test_pd_cuda.py (PD == colocated with the Commit overlap).
set -uo pipefail
START=$(date +%s); OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
el() { echo "$(( $(date +%s) - START )) s"; }
timeout 90 python3 benchmarks/allreduce_sweep.py --rows 1,16,64,128,256 --out "$OUT/allreduce_oneshot.jsonl" 2>&1 \
  | grep -E "all-reduce|Error|error|Traceback" | tail -8
echo "sweep done ($(el))"
timeout 170 python3 benchmarks/tp_decode.py --jobs "nemotron-h-8b:1,nemotron-h-8b:2" --modes graph --prefill-tokens 0 \
  --steps 20 --job-timeout 80 --out "$OUT/tp_oneshot.json" > "$OUT/tp_oneshot.log" 2>&1
echo "tp_decode one-shot: exit $? ($(el))"; grep -v "^{" "$OUT/tp_oneshot.log" | grep -v "^\[rank" | tail -6
HYBRIDPD_TP_ALLREDUCE=nccl timeout 100 python3 benchmarks/tp_decode.py --jobs "nemotron-h-8b:2" --modes graph \
  --prefill-tokens 0 --steps 20 --job-timeout 80 --out "$OUT/tp_nccl.json" > "$OUT/tp_nccl.log" 2>&1
echo "tp_decode NCCL: exit $? ($(el))"; grep -v "^{" "$OUT/tp_nccl.log" | grep -v "^\[rank" | tail -4
( timeout 250 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_pd_cuda.py > "$OUT/pd_cuda.log" 2>&1;
  echo "test_pd_cuda: exit $?" >> "$OUT/pd_cuda.log" ) &
timeout 250 python3 benchmarks/tp_pd_nixl.py --models nemotron_h --out "$OUT/tp_pd_nixl_oneshot.json" \
  > "$OUT/tp_pd_nixl.log" 2>&1
echo "tp_pd_nixl: exit $? ($(el))"; grep -E "hetero|identical|Error|error|timed out|Traceback" "$OUT/tp_pd_nixl.log" | head -8
wait; tail -4 "$OUT/pd_cuda.log"; echo "all done ($(el))"
echo "== step table"
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/tp_*.json")):
    try:
        rows = json.load(open(f))
    except Exception as e:
        print(f, "unreadable", e); continue
    for r in rows if isinstance(rows, list) else [rows]:
        if "step_ms" in r or "tp" in r:
            print(f.split("/")[-1], {k: r.get(k) for k in ("preset", "tp", "mode", "step_ms", "identical")})
PY
