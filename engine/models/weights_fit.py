"""What a model's weights take on the device, checked before they are allocated.

A model is built on the meta device, in whatever dtype its modules default to (fp32); its tensors take their final
dtype (the requested one, fp32 where the class keeps it) here, still on meta, so that materialising them allocates
each weight once, at its final size. A model whose weights cannot fit fails here with the numbers, before any
weight reaches the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hybridpd.engine.errors import ModelLoadError


def cast_meta(model: Any, keep_fp32: Callable[[str], bool], dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer of `model` its final dtype (no memory is allocated)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        want = torch.float32 if keep_fp32(name) else dtype
        if t.dtype != want:
            t.data = torch.empty_like(t, dtype=want)


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers in their current dtypes (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (what this process's allocator caches counts as free); None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def require_room(nbytes: int, free: int | None, what: str = "the model's weights") -> None:
    """Raise ModelLoadError, with the numbers, when `nbytes` exceed `free` (None: not checked, e.g. the CPU)."""
    if free is not None and nbytes > free:
        raise ModelLoadError(
            f"the model does not fit: {what} take {nbytes / 2**30:.1f} GiB, the device has {free / 2**30:.1f} GiB "
            f"free: use a smaller dtype (--dtype bfloat16), spread the model over more GPUs (--tensor-parallel-size), "
            f"or use a GPU with more memory"
        )
