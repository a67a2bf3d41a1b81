# Sourced by the gpu_*.sh suites on a device machine (a copy of the repository, nothing installed): the carried
# wheels (${WHL:-.whl}: nixl, the fastapi stack, fla-core, xgrammar; none is required) into /tmp/site, the package
# importable as `hybridpd` from the source tree (links hybridpd/<runtime folder> -> ../<folder>, as setup.py maps
# them for an install), the device's grpcio accepted by the committed stubs (the generated API is the same), and
# NVLink multicast kept off in NCCL, PyTorch and NVSHMEM. Triton's kernel cache starts from ${TRITON_TGZ:-.triton/
# cache.tgz} when carried (fla-core's kernels take minutes to compile and autotune per shape; the same cache serves
# any Hopper card); `save_triton_cache` writes it back to $OUT for the next session to carry.
WHL=${WHL:-.whl}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
TRITON_TGZ=${TRITON_TGZ:-.triton/cache.tgz}
[ -f "$TRITON_TGZ" ] && tar -xzf "$TRITON_TGZ" -C "$TRITON_CACHE_DIR" && echo "triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files from $TRITON_TGZ"
save_triton_cache() {  # into $OUT (at most 16 MiB comes back): copy to the repo's .triton/ to carry it next time
  tar -czf "${OUT:-out}/cache.tgz" -C "$TRITON_CACHE_DIR" . && ls -la "${OUT:-out}/cache.tgz"
}
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl \
    && export PYTHONPATH=/tmp/site
fi
for d in engine prefill decode kvtransfer proto proxy deploy worker; do ln -sfn "../$d" "hybridpd/$d"; done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRITON_CACHE_AUTOTUNING=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GRPC_RT=$(python3 -c "import grpc; print(grpc.__version__)")
sed -i "s/GRPC_GENERATED_VERSION = '[0-9.]*'/GRPC_GENERATED_VERSION = '$GRPC_RT'/" proto/hybridpd_pb2_grpc.py
nvidia-smi -L
python3 - <<'PY'
import importlib, importlib.util, torch
import hybridpd.engine.core as core
have = {m: getattr(importlib.import_module(m), "__version__", "ok") for m in ("nixl", "fla", "triton", "transformers")
        if importlib.util.find_spec(m)}
print("torch", torch.__version__, torch.cuda.device_count(), "GPUs, nccl", torch.cuda.nccl.version(), "|", have,
      "| hybridpd from", core.__file__)
PY
