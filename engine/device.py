"""`--device auto` / `--dtype auto`: what an engine runs on when not told (vLLM's meaning of auto).

device auto -> "cuda" when torch sees a CUDA device, else "cpu"
dtype  auto -> "bfloat16" on a CUDA device that supports it, "float16" on one that does not, "float32" on CPU
"""

from __future__ import annotations

import torch


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    if not resolve_device(device).startswith("cuda"):
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


FAST_PATH_PACKAGES = (("fla", "fla-core"), ("triton", "triton"))
"""(import name, package) the CUDA fast path needs; `pip install 'hybridpd[gpu]'` installs them."""


def missing_fast_path_packages() -> list[str]:
    import importlib.util

    return [pkg for mod, pkg in FAST_PATH_PACKAGES if importlib.util.find_spec(mod) is None]


def require_fast_path(device: str, allow_reference_path: bool) -> None:
    """On CUDA, refuse (InvalidRequestError, naming the packages) to start an engine that would fall back to the
    reference path (2-3x slower), unless allowed."""
    from hybridpd.engine.errors import InvalidRequestError

    missing = missing_fast_path_packages() if device.startswith("cuda") else []
    if missing and not allow_reference_path:
        raise InvalidRequestError(
            f"{', '.join(missing)} not installed: this CUDA engine would run the slow reference path. Install the "
            f"GPU extra (pip install 'hybridpd[gpu]') or pass --allow-reference-path (LLM(allow_reference_path="
            f"True)) to run it anyway"
        )
