#!/usr/bin/env bash
# One GPU call: the oracle on CUDA (fp32 exact, bf16 close), the GPU-marked unit tests, the zeroing benchmark and
# offline throughput. Run from the repo root on the GPU box; results under ${OUT:-out}.
# Carry a transformers==5.23.0 wheel in .whl_a (the version the CPU oracle uses).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
WHL=.whl_a source benchmarks/gpu_env.sh
python3 -m pip list 2>/dev/null | grep -iE "^(grpcio|protobuf|httpx|prometheus.client|numpy) " || true
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_oracle_cuda.py tests/unit/test_zero_blocks.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 benchmarks/diag_engine_memory.py 2>&1 | tail -12
python3 benchmarks/zeroing.py --out "$OUT/zeroing.json" 2>&1 | tail -15
python3 benchmarks/offline_throughput.py --device cuda --dtype bfloat16 --sizes tiny,small,medium --out "$OUT/offline_gpu_bf16.json" 2>&1 | grep -v "^{" | tail -8
python3 benchmarks/offline_throughput.py --device cuda --dtype float32 --sizes tiny,small --out "$OUT/offline_gpu_fp32.json" 2>&1 | grep -v "^{" | tail -6
