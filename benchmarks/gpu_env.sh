# Sourced by the gpu_*.sh suites on a device machine (a copy of the repository, nothing installed): the carried
# wheels (${WHL:-.whl}: nixl, the fastapi stack, fla-core, xgrammar; none is required) into /tmp/site, the package
# importable as `hybridpd` from the source tree (links hybridpd/<runtime folder> -> ../<folder>, as setup.py maps
# them for an install), the device's grpcio accepted by the committed stubs (the generated API is the same), and
# NVLink multicast kept off in NCCL, PyTorch and NVSHMEM.
WHL=${WHL:-.whl}
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
