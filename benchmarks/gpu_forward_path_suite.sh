#!/usr/bin/env bash
# One forward per path, on one GPU (plain processes, no Ray). Carry .whl (gpu_env.sh). Two calls, each < 8 min:
#   bench  decode steps with CUDA graphs and eager, and one 8k-token prefill, on the 8B presets (benchmarks/
#          roofline.py; table on stdout, JSON under $OUT). Run it at the commit before the change and at the change
#          on the same warm machine (LABEL=before / LABEL=after) and compare step_ms row by row.
#   tests  the GPU tests of the forward paths: batched vs reference on CUDA (fp32 identical, bf16 as precise, MoE,
#          split cache groups with graphs) and the fused kernels against the mixers' reference steps; TESTS=...
#          adds e.g. tests/gpu/test_poison_cuda.py tests/gpu/test_oracle_cuda.py.
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
  *) echo "usage: $0 bench|tests" >&2; exit 2 ;;
esac
