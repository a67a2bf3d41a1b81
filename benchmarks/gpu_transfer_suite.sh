#!/usr/bin/env bash
# One 2-GPU call (nvidia-h200-x2): PD correctness on CUDA (P on GPU 0, D on GPU 1) and the KV transfer benchmark on
# one GPU (two processes) and across two, both cache layouts, plus a release-notice sweep. Carry .whl
# (shared/tools/device-wheels.sh all). Results under ${OUT:-out}.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NIXL_LOG_LEVEL=WARN
source benchmarks/gpu_env.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_pd_cuda.py 2>&1 | tee "$OUT/gpu_pd_tests.log" | tail -8
# both cache layouts (stacked: what the engine allocates; per_layer: one tensor per layer), the default mode
for pair in 0:0 0:1; do
  timeout 200 python3 benchmarks/transfer.py --device cuda --src-gpu "${pair%:*}" --dst-gpu "${pair#*:}" --repeats 8 \
    --modes per_transfer --layouts stacked,per_layer --scenarios realistic-contig,realistic-frag,deep-frag,large,xlarge \
    --json "$OUT/transfer_${pair/:/_}.json" 2>&1 | grep -v "NIXL INFO" | tail -28
done
# release notice with the READ (default) vs after DONE, stacked layout, fresh P/D per setting
timeout 200 python3 benchmarks/transfer_sweep.py --settings default,notice_after --pairs 0:0,0:1 \
  --json "$OUT/transfer_sweep.json" --log "$OUT/transfer_sweep.log" 2>&1 | tail -20
