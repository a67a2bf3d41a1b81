#!/usr/bin/env bash
# One 2-GPU call: PD-vs-colocated serving (one GPU shared; P and D on their own GPUs). The KV transfer benchmark
# and the PD correctness test on CUDA are in gpu_transfer_suite.sh. Carry .whl (shared/tools/device-wheels.sh all:
# nixl + the fastapi stack).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import nixl, torch; print('nixl ok', torch.cuda.device_count())"
python3 benchmarks/serve_compare.py --device cuda --dtype bfloat16 --size medium --gpus 0,0 \
  --out "$OUT/serve_1gpu.json" > "$OUT/serve_1gpu.log" 2>&1; grep -E "^(mode|pd|colocated) \|" "$OUT/serve_1gpu.log" \
  || grep -v "NIXL INFO" "$OUT/serve_1gpu.log" | tail -30
python3 benchmarks/serve_compare.py --device cuda --dtype bfloat16 --size medium --gpus 0,1 --modes pd \
  --out "$OUT/serve_2gpu.json" > "$OUT/serve_2gpu.log" 2>&1; grep -E "^(mode|pd|colocated) \|" "$OUT/serve_2gpu.log" \
  || grep -v "NIXL INFO" "$OUT/serve_2gpu.log" | tail -30
