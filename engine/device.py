"""`--device auto` / `--dtype auto`: what an engine runs on when not told (vLLM's meaning of auto).

device auto -> "cuda" when torch sees a CUDA device, else "cpu"
dtype  auto -> on CUDA, vLLM's rule: the checkpoint's own dtype (config.json's `dtype` / `torch_dtype`) when the
               GPU supports it; a float32 (or unnamed) checkpoint runs in the GPU's preferred dtype, bfloat16
               (float16 on a GPU without native bf16, before compute capability 8.0, which also runs a bfloat16
               checkpoint in float16, with a warning; an explicit --dtype bfloat16 is refused there, as vLLM).
               On the CPU: float32 (unlike vLLM, which would use bfloat16 there: the CPU runs the reference path,
               whose float32 output is token-identical to transformers').
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger("hybridpd.engine")

DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
"""Spellings of a dtype in config.json (`torch_dtype`, with or without a `torch.` prefix) -> the engine's name."""


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def checkpoint_dtype(hf_config: Mapping[str, Any] | None) -> str | None:
    """The dtype config.json names (`dtype`, else `torch_dtype`, of the root or its text_config); None when it
    names none the engine knows."""
    if not hf_config:
        return None
    text = hf_config.get("text_config")
    for cfg in (hf_config, text if isinstance(text, Mapping) else {}):
        for key in ("dtype", "torch_dtype"):
            raw = cfg.get(key)
            if isinstance(raw, str) and raw.removeprefix("torch.").lower() in DTYPE_NAMES:
                return DTYPE_NAMES[raw.removeprefix("torch.").lower()]
    return None


def native_bf16() -> bool:
    """Whether this CUDA device computes in bfloat16 (compute capability 8.0 on, as vLLM asks): torch's default
    answer also counts the emulation of older GPUs (T4, V100), which is slow and not what the kernels support."""
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def cuda_dtypes() -> tuple[str, ...]:
    """The dtypes this CUDA device runs, preferred first (vLLM's order: bf16 from Ampere on)."""
    return ("bfloat16", "float16", "float32") if native_bf16() else ("float16", "float32")


def resolve_dtype(dtype: str, device: str, hf_config: Mapping[str, Any] | None = None) -> str:
    """`dtype`, or for "auto" what an engine on `device` runs the checkpoint of `hf_config` (its config.json) in:
    see the module's docstring."""
    if dtype != "auto":
        named = DTYPE_NAMES.get(dtype, dtype)  # vLLM's half / float
        if named == "bfloat16" and resolve_device(device).startswith("cuda") and torch.cuda.is_available():
            if not native_bf16():
                from hybridpd.engine.errors import InvalidRequestError

                raise InvalidRequestError(
                    "--dtype bfloat16 needs a GPU of compute capability 8.0 or more (Ampere on); this one runs "
                    "float16: use --dtype half (or auto)"
                )
        return named
    if not resolve_device(device).startswith("cuda"):
        return "float32"
    supported = cuda_dtypes()
    own = checkpoint_dtype(hf_config)
    if own is None or own == "float32":  # vLLM downcasts float32 checkpoints to the preferred dtype
        return supported[0]
    if own in supported:
        return own
    log.warning("this GPU does not support the checkpoint's %s: running it in %s", own, supported[0])
    return supported[0]


def describe_auto(
    device: str, dtype: str, resolved_device: str, resolved_dtype: str, hf_config: Mapping[str, Any] | None = None
) -> str | None:
    """One line saying what `auto` chose and why (None when neither was auto): the start-up log."""
    parts = []
    if device == "auto":
        why = "a CUDA device is visible" if resolved_device.startswith("cuda") else "no CUDA device is visible"
        parts.append(f"device auto -> {resolved_device} ({why})")
    if dtype == "auto":
        own = checkpoint_dtype(hf_config)
        if not resolved_device.startswith("cuda"):
            why = "the CPU runs float32"
        else:
            why = f"the checkpoint's dtype is {own}" if own else "the checkpoint names no dtype"
            if own != resolved_dtype:
                why += f"; the GPU's preferred dtype is {cuda_dtypes()[0]}"
        parts.append(f"dtype auto -> {resolved_dtype} ({why})")
    return ", ".join(parts) or None


FAST_PATH_PACKAGES = (("fla", "fla-core"), ("triton", "triton"))
"""(import name, package) the CUDA fast path needs; `pip install 'hybridpd[gpu]'` installs them."""


def missing_fast_path_packages(import_them: bool = False) -> list[str]:
    """The fast path's packages that are not installed; with `import_them`, also those installed that fail to
    import (a build for another torch or triton), each with why."""
    import importlib
    import importlib.util

    out = []
    for mod, pkg in FAST_PATH_PACKAGES:
        if importlib.util.find_spec(mod) is None:
            out.append(f"{pkg} (not installed)")
        elif import_them:
            try:
                importlib.import_module(mod)
            except Exception as e:  # noqa: BLE001 - any failure to import leaves the fast path unusable
                out.append(f"{pkg} (installed, but `import {mod}` fails: {type(e).__name__}: {e})")
    return out


def require_device(device: str) -> None:
    """InvalidRequestError when `device` names a CUDA device this process cannot see (before anything is loaded,
    and before the fast path's packages are asked for: they would not help)."""
    from hybridpd.engine.errors import InvalidRequestError

    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= count:
        if count:
            why = f"{count} are visible"
        elif torch.version.cuda is None:
            why = f"torch {torch.__version__} is a CPU build"
        else:
            why = "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)"
        raise InvalidRequestError(
            f"--device {device}: no such CUDA device ({why}); --device auto picks the CPU where there is no GPU"
        )


def require_fast_path(device: str, allow_reference_path: bool) -> None:
    """On CUDA, refuse (InvalidRequestError, naming the packages) to start an engine that would fall back to the
    reference path (2-3x slower) or fail at its first step, unless allowed."""
    from hybridpd.engine.errors import InvalidRequestError

    if not device.startswith("cuda") or allow_reference_path:
        return
    missing = missing_fast_path_packages(import_them=True)
    if missing:
        raise InvalidRequestError(
            f"the CUDA fast path needs {'; '.join(missing)}: this engine would run the slow reference path. Install "
            f"the GPU extra (pip install 'hybridpd[gpu]') or pass --allow-reference-path (LLM(allow_reference_path="
            f"True)) to run it anyway"
        )
