"""The tensor-parallel block end in one kernel: sum over ranks + residual add + the next RMSNorm, for decode-sized
bf16/fp16 activations on CUDA.

A decode step of a TP worker ends every block with a row-parallel projection whose partial sums must be added over
the ranks before the residual add and the next block's norm. NCCL's all-reduce costs ~8-12 us per call at decode
sizes (its floor, mostly synchronisation; PyTorch's symmetric-memory one-shot kernel, with its two cross-GPU
barriers, was slower still), then the norm is one more launch. Here one kernel per row does all of it:

    rank r, row i:  x_r --store over NVLink--> slot[site, r, i] of every peer's buffer
                    wait until slot[site, p, i] of its own buffer holds peer p's row (no -0.0 left), mark it empty
                    s = sum over p in rank order (fp32, rounded to the dtype: the all-reduce's result)
                    h = s + residual (rounded);  out = RMSNorm(h)          -> (out, h), as engine.kernels.fused.rms_norm

The data is its own flag (a Lamport-style exchange): a slot is empty when it holds -0.0 in every element, a
writer turns -0.0 into +0.0 (the same sum), and the reader empties the slot after reading it. No barrier, no
signal pad. Every call site of a forward (a block end) has its own slot, so a rank may write site k of the next
step only after every rank has read site k of this one: to get there it needs every other site's data of this
step, which its peers send only after they emptied site k. The ranks sum in the same order, so every rank holds
the same h (two ranks: the same bits as NCCL's sum and the separate norm kernel).

Used by the models' batched forward when every rank runs this path (CUDA, world >= 2, bf16/fp16, at most
`max_rows` rows: decode steps and CUDA graphs); prefill-sized steps, fp32 (whose tests must be exact) and CPU keep
NCCL/gloo and the separate norm. `HYBRIDPD_TP_FUSED_ALLREDUCE=0` turns it off. The buffer is capped
(`HYBRIDPD_TP_FUSED_MAX_MIB`, 128): a wide model at a large TP size fuses fewer rows. A rank that dies or is
stopped leaves its peers spinning here; rank 0's watch ends the worker (exit 70) and its launcher restarts it whole.
The spin has no time limit of its own: a rank alive but stuck elsewhere leaves its peers here for good (NCCL's
watchdog would abort after the group's timeout); the worker's stall watchdog then reports it not ready, and the
proxy moves its requests to other workers.
Ownership: built once per rank by the engine after the model is cut (a collective: every rank at the same point)
and kept in the group's `BlockReduce` (engine.parallel.group), which the model (a scope per forward) and the
row-parallel hooks (no all-reduce inside a scope) share.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from hybridpd.engine.kernels.fused import rms_norm_row

log = logging.getLogger("hybridpd.tp")

MAX_WORLD = 8
EMPTY = -32768
"""The int16 bits of -0.0 in bf16 and fp16: an empty slot element."""
_EMPTY = tl.constexpr(EMPTY)



@triton.jit
def _buffer(p: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
    """Rank p's exchange buffer (as mapped in this process)."""
    if p == 0:
        return b0
    elif p == 1:
        return b1
    elif p == 2:
        return b2
    elif p == 3:
        return b3
    elif p == 4:
        return b4
    elif p == 5:
        return b5
    elif p == 6:
        return b6
    else:
        return b7


@triton.jit
def _reduce_add_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, b0, b1, b2, b3, b4, b5, b6, b7, site_off, D,
                            eps, RANK: tl.constexpr, WORLD: tl.constexpr, ROWS: tl.constexpr,
                            ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < D
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + i * D + d, mask=m, other=0.0)
    x = tl.where(x.to(tl.int16, bitcast=True) == _EMPTY, tl.zeros_like(x), x)  # -0.0 marks an empty slot
    empty = tl.full([BLOCK], _EMPTY, tl.int16).to(dt, bitcast=True)
    for p in tl.static_range(WORLD):  # my row into slot RANK of every peer's buffer
        if p != RANK:
            tl.store(_buffer(p, b0, b1, b2, b3, b4, b5, b6, b7) + site_off + (RANK * ROWS + i) * D + d, x, mask=m)
    acc = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(WORLD):  # every rank's row, in rank order
        if p == RANK:
            acc += x.to(tl.float32)
        else:
            slot = _buffer(RANK, b0, b1, b2, b3, b4, b5, b6, b7) + site_off + (p * ROWS + i) * D + d
            v = tl.load(slot, mask=m, other=0.0, volatile=True)
            while tl.sum(((v.to(tl.int16, bitcast=True) == _EMPTY) & m).to(tl.int32), 0) > 0:
                v = tl.load(slot, mask=m, other=0.0, volatile=True)
            tl.store(slot, empty, mask=m)
            acc += v.to(tl.float32)
    s = acc.to(dt)  # the all-reduce's result, in the model dtype
    res = tl.load(res_ptr + i * D + d, mask=m, other=0.0)
    h = (s.to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(h_ptr + i * D + d, h, mask=m)
    y = rms_norm_row(h, w_ptr, d, m, D, eps, ZERO_CENTERED)  # rms_norm's own arithmetic: the same bits
    tl.store(out_ptr + i * D + d, y.to(dt), mask=m)


class FusedReduceNorm:
    """One rank's exchange buffer ([sites, world, max_rows, hidden], mapped by every peer) and the kernel over it."""

    def __init__(self, group: Any, rank: int, world: int, device: torch.device, hidden: int, max_rows: int,
                 sites: int, dtype: torch.dtype, agree: Callable[[int], int] | None = None) -> None:
        """Allocate, map every peer's buffer, wait until all are empty. Collective over `group`. `agree` (the
        control group's agree_min): called by every rank after each local part (allocation; mapping), so that a
        part failing on one rank alone (its GPU out of memory, no peer access from it) fails every rank there,
        before any of them enters the next collective (the rendezvous, the barrier) and waits for it alone."""
        import torch.distributed as dist

        if not 2 <= world <= MAX_WORLD:
            raise ValueError(f"fused all-reduce: world {world} outside 2..{MAX_WORLD}")
        self.rank, self.world, self.hidden, self.max_rows, self.sites, self.dtype = (
            rank, world, hidden, max_rows, sites, dtype)
        self.site_numel = world * max_rows * hidden
        numel = sites * self.site_numel
        _on_every_rank(agree, "allocate", lambda: self._allocate(numel, device))
        _on_every_rank(agree, "map", lambda: self._map(group, numel))
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every buffer is empty before anyone writes into it
        self.nbytes = numel * self.buffer.element_size()
        self.site = 0

    def _allocate(self, numel: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(numel, dtype=self.dtype, device=device)
        self.buffer.view(torch.int16).fill_(EMPTY)

    def _map(self, group: Any, numel: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        if handle is None:
            raise RuntimeError("symmetric-memory rendezvous returned no handle")
        self.peers = [handle.get_buffer(p, (numel,), self.dtype) for p in range(self.world)]
        self.peers += [self.peers[0]] * (MAX_WORLD - self.world)

    def begin(self) -> None:
        self.site = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """rms_norm's call with x the rank's partial sum: (RMSNorm(sum(x) + residual), sum(x) + residual)."""
        assert residual is not None and x.shape == residual.shape and x.shape[-1] == self.hidden
        assert residual.is_contiguous() and x.dtype == residual.dtype == self.dtype
        if self.site >= self.sites:
            raise RuntimeError(f"fused all-reduce: more than {self.sites} block ends in one forward")
        x = x.contiguous()
        out, h = torch.empty_like(x), torch.empty_like(x)
        rows = x.shape[0]
        if rows:
            _reduce_add_norm_kernel[(rows,)](
                x, residual, weight, out, h, *self.peers, self.site * self.site_numel, self.hidden, eps,
                RANK=self.rank, WORLD=self.world, ROWS=self.max_rows, ZERO_CENTERED=zero_centered,
                BLOCK=triton.next_power_of_2(self.hidden), num_warps=8 if self.hidden >= 2048 else 4)
        self.site += 1
        return out, h


def _on_every_rank(agree: Callable[[int], int] | None, what: str, part: Callable[[], None]) -> None:
    """Run one rank's local part of the set-up, then (with `agree`) learn whether every rank's succeeded: raise on
    every rank unless all did. A rank whose part failed still joins the agreement before it raises."""
    try:
        part()
    except Exception:
        if agree is not None:
            agree(0)
        raise
    if agree is not None and agree(1) == 0:
        raise RuntimeError(f"another rank could not {what} its exchange buffer")


DEFAULT_MAX_EXCHANGE_MIB = 128
"""Most GPU memory the exchange buffer may take from the cache (`HYBRIDPD_TP_FUSED_MAX_MIB`): it grows with block
ends x TP size x rows x hidden, so a wide model at TP 8 fuses fewer rows (larger steps keep NCCL)."""


def _max_exchange_bytes() -> int:
    return int(os.environ.get("HYBRIDPD_TP_FUSED_MAX_MIB", DEFAULT_MAX_EXCHANGE_MIB)) << 20


def rows_that_fit(max_rows: int, sites: int, world: int, hidden: int, dtype: torch.dtype) -> int:
    """The most rows a fused step may have: `max_rows`, or fewer when the buffer would exceed its cap."""
    per_row = sites * world * hidden * dtype.itemsize
    return min(max_rows, _max_exchange_bytes() // per_row)


def build(tp: Any, model: Any, device: torch.device, dtype: torch.dtype, max_rows: int) -> int:
    """Give `tp.block_reduce` a fused kernel when this worker can use one; returns the bytes it took (0: none, the
    reason logged). Called on every rank at the same point, after the model is cut."""
    sites = int(getattr(model, "block_ends", 0))
    hidden = int(getattr(model, "hidden_size", 0))
    if (os.environ.get("HYBRIDPD_TP_FUSED_ALLREDUCE", "1") == "0" or device.type != "cuda" or tp.world < 2
            or dtype not in (torch.bfloat16, torch.float16) or not sites or not hidden):
        return 0
    max_rows = rows_that_fit(max_rows, sites, tp.world, hidden, dtype)
    if max_rows < 1:
        log.info("tensor parallel: the fused all-reduce's exchange buffer would exceed %d MiB for one row; NCCL for "
                 "every block end", _max_exchange_bytes() >> 20)
        return 0
    fused: FusedReduceNorm | None = None
    try:
        fused = FusedReduceNorm(tp.group, tp.rank, tp.world, device, hidden, max_rows, sites, dtype, tp.agree_min)
    except Exception as e:  # no peer access between the GPUs, an old torch: NCCL serves every block end
        log.warning("tensor parallel: fused all-reduce + norm unavailable (%s); NCCL for every block end", e)
    if tp.agree_min(int(fused is not None)) == 0:  # all ranks fuse or none does
        return 0
    assert fused is not None
    tp.block_reduce.fused = fused
    log.info("tensor parallel: fused all-reduce + residual norm for steps of <= %d rows (%d block ends, %.1f MiB "
             "exchange buffer), NCCL above", max_rows, sites, fused.nbytes / 2**20)
    return fused.nbytes


__all__ = ["DEFAULT_MAX_EXCHANGE_MIB", "FusedReduceNorm", "build", "rows_that_fit"]
