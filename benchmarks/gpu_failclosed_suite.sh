#!/usr/bin/env bash
# One 1-GPU call: the fail-closed handoff on CUDA. The PD correctness test (P and D share the GPU; D commits each
# pull with P before using it) and the Commit-vs-pull benchmark. Carry .whl-pd (nixl + the fastapi stack:
# shared/tools/device-wheels.sh's "all" set, downloaded into .whl-pd).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-pd/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PYTHONPATH:$PWD"
# The device image's grpcio may be older than the one the stubs were generated with; the generated API is the same.
sed -i "s/GRPC_GENERATED_VERSION = '[0-9.]*'/GRPC_GENERATED_VERSION = '1.0.0'/" proto/hybridpd_pb2_grpc.py
nvidia-smi -L
python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_pd_cuda.py ${PD_TEST_ARGS:-} > "$OUT/gpu_pd_failclosed.log" 2>&1
grep -v "NIXL INFO" "$OUT/gpu_pd_failclosed.log" | grep -E "Error|error|passed|failed|assert" | tail -25
python3 benchmarks/handoff_commit.py --device cuda --dtype bfloat16 --lengths 512,2048,4000 --requests ${REQUESTS:-30} \
  --out "$OUT/handoff_commit_h200.json" > "$OUT/handoff.log" 2>&1
grep -v "NIXL INFO\|INFO hybridpd\|WARNING hybridpd" "$OUT/handoff.log" | tail -12
