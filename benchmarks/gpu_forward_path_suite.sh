#!/usr/bin/env bash
# One forward per path, on one GPU (plain processes, no Ray). Carry .whl (gpu_env.sh). Two calls, each < 8 min:
#   bench  decode steps with CUDA graphs and eager, and one 8k-token prefill, on the 8B presets (benchmarks/
#          roofline.py; table on stdout, JSON under $OUT). Run it at the commit before the change and at the change
#          on the same warm machine (LABEL=before / LABEL=after) and compare step_ms row by row.
#   tests  the GPU tests of the forward paths: batched vs reference on CUDA (fp32 identical, bf16 as precise, MoE,
#          split cache groups with graphs) and the fused kernels against the mixers' reference steps; TESTS=...
#          adds e.g. tests/gpu/test_poison_cuda.py tests/gpu/test_oracle_cuda.py.
#   check  one 2-GPU call: the GPU tests above with the oracle, poison and PD ones, the 8B decode step at batch 64
#          (graphs, roofline.py; compare with the figures recorded before), and Nemotron-3-Nano-30B-A3B at TP 2 with
#          TP inside the experts vs expert parallelism (benchmarks/tp_decode.py).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
case "${1:-bench}" in
  bench)
    timeout 420 python3 benchmarks/roofline.py --batches "${BATCHES:-1,64,256}" --contexts 1024,8192 \
      --out "$OUT/roofline_${LABEL:-run}.json" 2>&1 | grep -v '^{' | tail -32 ;;
  tests)
    timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fast_path_cuda.py \
      tests/gpu/test_fused_kernels_cuda.py ${TESTS:-} 2>&1 | tail -30 ;;
  check)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -12
    CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/roofline.py --presets nemotron-h-8b --batches 64 \
      --contexts 1024 --modes graph --prefill-tokens 0 --out "$OUT/roofline_check.json" 2>&1 | grep -v '^{' | tail -5
    timeout 200 python3 benchmarks/tp_decode.py --jobs nemotron-3-nano-30b-a3b:2,nemotron-3-nano-30b-a3b:2:ep \
      --modes graph --prefill-tokens 0 --job-timeout 95 --out "$OUT/tp_ep.json" 2>&1 | grep -v '^{' \
      | grep -v '^\[rank\|^frame\|^Exception' | tail -6 ;;
  *) echo "usage: $0 bench|tests|check" >&2; exit 2 ;;
esac
