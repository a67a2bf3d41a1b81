#!/usr/bin/env bash
# One 2-GPU call (< 9 min): does PD pay? benchmarks/goodput.py on the Nemotron-H-8B preset, long-prompt workload,
# 2 colocated replicas (least-loaded) vs 1P1D (and the adaptive policy when the proxy offers it): the low-load check
# (PD TTFT p50 vs colocated, D's TPOT vs its engine's decode step, both from the same run) and goodput per GPU at
# the tight (TTFT<=1 s, TPOT<=25 ms) and loose (TTFT<=2 s, TPOT<=60 ms) SLOs. Then, with the time left, Qwen3.5-9B
# and the chat-like workload, and roofline.py for Nemotron-3-Nano-30B-A3B on one GPU (cache sized from what the
# weights leave). Prints the bar checks and one table per run last. Results (JSON) under ${OUT:-out}.
# Carry .whl: nixl, the fastapi stack and fla-core (+ einops) wheels, as for gpu_pd_suite.sh / gpu_fast_path_suite.sh.
#   SUITE_BUDGET_S (default 510): wall-clock budget of the whole script; RATES / DURATION override the sweep.
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-out}; mkdir -p "$OUT"
BUDGET=${SUITE_BUDGET_S:-510}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRITON_CACHE_AUTOTUNING=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
# The device image's grpcio may be older than the one the committed stubs were generated with; the API is the same.
GRPC_RT=$(python3 -c "import grpc; print(grpc.__version__)")
sed -i "s/GRPC_GENERATED_VERSION = '[0-9.]*'/GRPC_GENERATED_VERSION = '$GRPC_RT'/" proto/hybridpd_pb2_grpc.py
nvidia-smi -L
python3 -c "import nixl, fla, torch; print('nixl ok, fla', fla.__version__, 'torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
run() {  # name, deadline seconds, goodput args...
  local name=$1 dl=$2; shift 2
  timeout $((dl + 60)) python3 benchmarks/goodput.py --device cuda --dtype bfloat16 --gpus 0,1 \
    --configs colocated,1p1d,adaptive \
    --rates "${RATES:-1.5,3,4.5,6}" --duration "${DURATION:-12}" --drain 12 --warmup-requests 32 --low-load 6 \
    --deadline-s "$dl" --out-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(left) s of the budget left)"; grep -E "^(==|  rate)" "$OUT/$name.log" | tail -20
}
run nemotron_long $(( $(left) - 90 > 380 ? 380 : $(left) - 90 )) --preset nemotron-h-8b --workloads long
if [ "$(left)" -gt 200 ]; then run qwen_long $(( $(left) - 40 )) --preset qwen3.5-9b --workloads long
else echo "qwen3.5-9b skipped: $(left) s left"; fi
if [ "$(left)" -gt 200 ]; then run nemotron_chat $(( $(left) - 40 )) --preset nemotron-h-8b --workloads chat
else echo "chat workload skipped: $(left) s left"; fi
if [ "$(left)" -gt 150 ]; then  # Nemotron-3-Nano-30B-A3B on one GPU: what fits after ~59 GiB of weights
  timeout 140 python3 benchmarks/roofline.py --presets nemotron-3-nano-30b-a3b --batches 1,64 --contexts 1024,8192 \
    --modes graph --prefill-tokens 4096 --steps 5 --out "$OUT/roofline_30b.json" > "$OUT/roofline_30b.log" 2>&1
  echo "30B roofline: exit $?"; grep -E '"weights_gib"|nemotron-3' "$OUT/roofline_30b.log" | tail -8
else echo "30B roofline skipped: $(left) s left"; fi
echo; echo "== results ($(( $(date +%s) - START )) s)"
python3 -m benchmarks.goodput_report "$OUT"/*/goodput.json || tail -30 "$OUT"/*.log
