#!/usr/bin/env bash
# One GPU call for the fast path: benchmarks/roofline.py, then fast vs reference path on CUDA (fp32 exact, bf16
# tokens; TESTS=... adds e.g. tests/gpu/test_oracle_cuda.py). The first GPU test of a process spends ~130 s compiling
# and autotuning Triton kernels (fla-core autotunes per shape); later ones take seconds. Carry .whl with fla-core, einops and
# transformers==5.23.0 wheels. Results under ${OUT:-out}.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
timeout ${BENCH_TIMEOUT:-280} python3 benchmarks/roofline.py --kernels --out "$OUT/roofline.json" ${ROOFLINE_ARGS:-} 2>&1 | tee "$OUT/roofline.log" | grep -v '^{"preset' | tail -40
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/gpu/test_fast_path_cuda.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
