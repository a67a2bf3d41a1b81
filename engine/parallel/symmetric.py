"""The small all-reduces of a decode step through PyTorch symmetric memory: every rank copies its partial sum into a
buffer that all ranks of the worker have mapped (NVLink peer memory), and one kernel on each rank reads every
peer's copy and adds them (`symm_mem.one_shot_all_reduce`). One kernel and no ring, so a decode step's [batch,
hidden] reduction costs a few microseconds where NCCL's ring costs tens; it is captured into CUDA graphs like any
kernel (the kernel's entry and exit barriers use the buffer's signal pads, so consecutive reductions never read a
copy a peer is still writing).

Larger messages (prefill chunks) go to NCCL, whose ring uses the links' bandwidth better. No multicast (the
`multimem` operations) is used. The sum of two ranks is the same IEEE addition NCCL does; with more ranks the order
of additions may differ from NCCL's (tokens are checked against TP 1, not against NCCL).

Ownership: one `SymmetricAllReduce` per (worker, dtype), created by every rank in the same order after the model is
sharded and before CUDA graphs are captured; it lives as long as the process.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger("hybridpd.tp")

ONE_SHOT_MAX_BYTES = 1 << 20
"""Messages up to this size use the one-shot kernel; larger ones NCCL (measured on two H100s: see BENCHMARKS)."""

DISABLE_ENV = "HYBRIDPD_TP_ALLREDUCE"
"""Set to `nccl` to use NCCL for every all-reduce (for comparison and as a way out)."""


class SymmetricAllReduce:
    """Sums a contiguous tensor over the group through one symmetric buffer of `max_bytes`."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._copy_op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum over ranks as a new tensor, or None when x does not fit this path (the caller uses NCCL)."""
        n = x.numel()
        if x.dtype != self.dtype or n > self.buffer.numel() or not x.is_contiguous():
            return None
        buf = self.buffer[:n]
        if self._copy_op is not None:
            return self._copy_op(buf, x.view(-1), "sum", self.group_name).view(x.shape)
        buf.copy_(x.view(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name).view(x.shape)


def symmetric_all_reduce(tp: Any, device: torch.device, dtype: torch.dtype) -> SymmetricAllReduce | None:
    """A `SymmetricAllReduce` for `tp` on CUDA, or None (CPU, one rank, disabled, or not available on every rank:
    the ranks agree, so either all of them use it or none)."""
    if device.type != "cuda" or tp.world < 2 or os.environ.get(DISABLE_ENV, "").lower() == "nccl":
        return None
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        ok = 1 if hasattr(torch.ops.symm_mem, "one_shot_all_reduce") else 0
    except Exception:  # noqa: BLE001 - a torch build without symmetric memory
        ok = 0
    if not tp.agree_min(ok):
        log.warning("tensor parallel: symmetric memory is not available on every rank; all-reduces use NCCL")
        return None
    fast = SymmetricAllReduce(tp.group, device, dtype, ONE_SHOT_MAX_BYTES)
    log.info(
        "tensor parallel: all-reduces up to %d KiB through symmetric memory (one-shot), larger through NCCL",
        ONE_SHOT_MAX_BYTES >> 10,
    )
    return fast


__all__ = ["DISABLE_ENV", "ONE_SHOT_MAX_BYTES", "SymmetricAllReduce", "symmetric_all_reduce"]
