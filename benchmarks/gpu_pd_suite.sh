#!/usr/bin/env bash
# One 2-GPU call: PD-vs-colocated serving (one GPU shared; P and D on their own GPUs). The KV transfer benchmark
# and the PD correctness test on CUDA are in gpu_transfer_suite.sh. Carry .whl (shared/tools/device-wheels.sh all:
# nixl + the fastapi stack).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PYTHONPATH:$PWD"
# The device image has grpcio 1.84; the committed stubs were generated with 1.85.1 and refuse older runtimes.
# The generated API is the same: relax the pin in this throwaway copy only.
sed -i "s/GRPC_GENERATED_VERSION = '1.85.1'/GRPC_GENERATED_VERSION = '1.84.0'/" proto/hybridpd_pb2_grpc.py
nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import nixl, torch; print('nixl ok', torch.cuda.device_count())"
python3 benchmarks/serve_compare.py --device cuda --dtype bfloat16 --size medium --gpus 0,0 \
  --out "$OUT/serve_1gpu.json" > "$OUT/serve_1gpu.log" 2>&1; grep -E "^(mode|pd|colocated) \|" "$OUT/serve_1gpu.log" \
  || grep -v "NIXL INFO" "$OUT/serve_1gpu.log" | tail -30
python3 benchmarks/serve_compare.py --device cuda --dtype bfloat16 --size medium --gpus 0,1 --modes pd \
  --out "$OUT/serve_2gpu.json" > "$OUT/serve_2gpu.log" 2>&1; grep -E "^(mode|pd|colocated) \|" "$OUT/serve_2gpu.log" \
  || grep -v "NIXL INFO" "$OUT/serve_2gpu.log" | tail -30
