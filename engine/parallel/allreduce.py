"""The tensor-parallel all-reduce of small activations in one kernel: PyTorch's symmetric-memory one-shot all-reduce.

A decode step all-reduces [batch, hidden] after every row-parallel projection (53 times a step for the 8B preset);
at decode sizes NCCL's ring costs ~8-12 us each (its floor, measured inside CUDA graphs), mostly synchronisation.
The one-shot kernel (`torch.ops.symm_mem.one_shot_all_reduce_copy_out`) copies the local input into a buffer every
rank mapped at start-up, waits on the peers' signal pads, reads every rank's buffer over NVLink and sums them in rank
order (so every rank gets the same bits), then waits once more so no rank overwrites its buffer while a peer still
reads it. One launch, no host involvement: it is captured in CUDA graphs like any kernel.

    x (local partial sum) --copy--> buffer[rank] ... barrier ... out = buffer[0] + buffer[1] + ... ... barrier

Used when the tensor is fp32/bf16, contiguous, 16-byte sized and at most `max_bytes` (prefill-sized tensors go to
NCCL, whose bandwidth wins there); otherwise, and on CPU, NCCL/gloo. `HYBRIDPD_TP_ALLREDUCE=nccl` turns it off;
`HYBRIDPD_TP_ONESHOT_MAX_BYTES` moves the size limit. NVLink multicast is never used (plain peer loads only).
Ownership: one per TPGroup on CUDA, built by `init_tp` (a collective: every rank builds it at the same point).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger("hybridpd.tp")

DEFAULT_MAX_BYTES = 1 << 20
"""Largest tensor sent through the one-shot kernel: [128, 4096] bf16. Above it every rank reading every peer's
whole tensor costs more than NCCL's ring (each rank reads 1/world of it twice)."""
DTYPES = (torch.float32, torch.bfloat16)
"""What the kernel reduces (PyTorch's one-shot kernel is built for these two)."""


class OneShotAllReduce:
    """One symmetric buffer of `max_bytes` per rank and the kernel over it."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if handle is None:
            raise RuntimeError("symmetric-memory rendezvous returned no handle")

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype in DTYPES and x.is_contiguous() and 0 < nbytes <= self.max_bytes and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, as a new tensor (x is left as it was)."""
        nbytes = x.numel() * x.element_size()
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)


def build(group: Any, device: torch.device, world: int) -> OneShotAllReduce | None:
    """The one-shot all-reduce for a CUDA group, or None (NCCL for everything) when it is turned off or the
    platform cannot map peer memory; the reason is logged. Called on every rank at the same point."""
    if os.environ.get("HYBRIDPD_TP_ALLREDUCE", "auto") == "nccl" or world < 2:
        return None
    max_bytes = int(os.environ.get("HYBRIDPD_TP_ONESHOT_MAX_BYTES", DEFAULT_MAX_BYTES))
    try:
        reducer = OneShotAllReduce(group, device, max_bytes)
    except Exception as e:  # an old torch, no peer access between the GPUs: NCCL serves every size
        log.warning("tensor parallel: one-shot all-reduce unavailable (%s); NCCL for every all-reduce", e)
        return None
    log.info("tensor parallel: one-shot all-reduce for tensors up to %d bytes, NCCL above", max_bytes)
    return reducer


__all__ = ["DEFAULT_MAX_BYTES", "OneShotAllReduce", "build"]
