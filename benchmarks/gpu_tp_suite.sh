#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU box (plain processes, NCCL, no Ray): the TP unit tests on CPU ranks, the 8B decode
# step at TP 2 vs TP 1 (batch 64), Nemotron-3-Nano-30B-A3B at TP 2, prefill at TP 2 vs torch.mm, and the fp32
# TP 2 == TP 1 greedy-token check through the engine. Run from the repo root; results under ${OUT:-out}.
# `gpu_tp_suite.sh nixl`: instead, P/D of different TP sizes over NIXL through worker processes (benchmarks/tp_pd_nixl.py).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
if [[ "${1:-}" == "nixl" ]]; then
  # `gpu_tp_suite.sh nixl`: hetero-TP PD through the serving path (worker processes, gRPC, one NIXL agent per rank,
  # VRAM): P TP 2 (cuda:0,1) -> D TP 1 (cuda:0) and P TP 1 (cuda:0) -> D TP 2 (cuda:0,1), fp32 tokens == colocated
  # TP 1, on NemotronH and Qwen3.5 (a separate run: the default one already takes most of the 8 minutes)
  timeout 420 python3 benchmarks/tp_pd_nixl.py --out "$OUT/tp_pd_nixl.json" 2>&1 | tail -40
  exit "${PIPESTATUS[0]}"
fi
timeout 470 python3 benchmarks/tp_decode.py --identity --job-timeout 150 --out "$OUT/tp_decode.json" 2>&1 | grep -v "^{" | tail -30
