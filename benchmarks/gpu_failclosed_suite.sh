#!/usr/bin/env bash
# One 1-GPU call: the fail-closed handoff on CUDA. The PD correctness test (P and D share the GPU; D commits each
# pull with P before using it) and the Commit-vs-pull benchmark. Carry .whl-pd (nixl + the fastapi stack:
# shared/tools/device-wheels.sh's "all" set, downloaded into .whl-pd).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
WHL=.whl-pd source benchmarks/gpu_env.sh
python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_pd_cuda.py ${PD_TEST_ARGS:-} > "$OUT/gpu_pd_failclosed.log" 2>&1
grep -v "NIXL INFO" "$OUT/gpu_pd_failclosed.log" | grep -E "Error|error|passed|failed|assert" | tail -25
python3 benchmarks/handoff_commit.py --device cuda --dtype bfloat16 --lengths 512,2048,4000 --requests ${REQUESTS:-30} \
  --out "$OUT/handoff_commit_h200.json" > "$OUT/handoff.log" 2>&1
grep -v "NIXL INFO\|INFO hybridpd\|WARNING hybridpd" "$OUT/handoff.log" | tail -12
