"""The fused TP block end's kernel (engine.parallel.fused_allreduce) on CPU under TRITON_INTERPRET=1, two ranks
played in turn in one process: rank 1's row is already in rank 0's slot (as if rank 1 had stored it), rank 0 runs,
then rank 1 reads what rank 0 stored. Both must give rms_norm's (normed, h) of the summed rows, -0.0 inputs (the
empty mark) included, and each reader must leave its slot empty. fp16 only: the interpreter rounds bf16 its own way
(tests/gpu/test_fused_allreduce_cuda.py checks bf16 and fp16 bit for bit against NCCL on two GPUs)."""

from __future__ import annotations

import os
import sys

import pytest

KERNEL_MODULES = ("hybridpd.engine.kernels.fused", "hybridpd.engine.parallel.fused_allreduce")
if any(m in sys.modules for m in KERNEL_MODULES) and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("Triton kernels already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402
from hybridpd.engine.kernels.fused import rms_norm  # noqa: E402
from hybridpd.engine.parallel import fused_allreduce as fa  # noqa: E402


def _rank(rank: int, bufs: list[torch.Tensor], hidden: int, max_rows: int, site: int) -> fa.FusedReduceNorm:
    """A rank's FusedReduceNorm over plain tensors (the GPU one maps its peers' buffers)."""
    f = object.__new__(fa.FusedReduceNorm)
    f.rank, f.world, f.hidden, f.max_rows, f.sites, f.dtype = rank, 2, hidden, max_rows, 2, torch.float16
    f.site_numel = 2 * max_rows * hidden
    f.peers = bufs + [bufs[0]] * (fa.MAX_WORLD - 2)
    f.site = site
    return f


@pytest.mark.parametrize("zero_centered", [False, True])
def test_two_ranks_sum_add_and_norm(zero_centered: bool) -> None:
    rows, hidden, max_rows, site = 3, 40, 4, 1
    bufs = [torch.empty(2 * 2 * max_rows * hidden, dtype=torch.float16) for _ in range(2)]
    for b in bufs:
        b.view(torch.int16).fill_(fa.EMPTY)
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(rows, hidden, generator=g).half() for _ in range(2)]
    x[1][:, ::5] = -0.0
    res, w = torch.randn(rows, hidden, generator=g).half(), torch.randn(hidden, generator=g).half()
    span = 2 * max_rows * hidden  # one block end's slots: [source rank, row, hidden]
    slots = [b[site * span : (site + 1) * span].view(2, max_rows, hidden) for b in bufs]
    slots[0][1, :rows] = x[1] + 0.0  # rank 1's store into rank 0's slot 1 (-0.0 written as +0.0)
    got0 = _rank(0, bufs, hidden, max_rows, site)(x[0], w, 1e-5, zero_centered, res)
    assert (slots[0][1, :rows].view(torch.int16) == fa.EMPTY).all()  # rank 0 emptied what it read
    assert torch.equal(slots[1][0, :rows], x[0] + 0.0)  # and stored its row into rank 1's slot 0
    got1 = _rank(1, bufs, hidden, max_rows, site)(x[1], w, 1e-5, zero_centered, res)
    assert (slots[1][0, :rows].view(torch.int16) == fa.EMPTY).all()
    want = rms_norm((x[0].float() + x[1].float()).half(), w, 1e-5, zero_centered, res)
    for got in (got0, got1):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_three_ranks_same_bits_on_every_rank() -> None:
    """TP 3 (ranks played 0, 1, 2; each peer's store placed where the kernel reads it): every rank sums in rank
    order in fp32 and rounds once, so all three hold the same bits (NCCL's ring may round after each add: bf16/fp16
    tolerance against it, exactness between the ranks); a NaN row stays NaN and is not taken for an empty slot."""
    world, rows, hidden, max_rows = 3, 2, 24, 3
    span = world * max_rows * hidden
    bufs = [torch.empty(span, dtype=torch.float16) for _ in range(world)]
    for b in bufs:
        b.view(torch.int16).fill_(fa.EMPTY)
    slots = [b.view(world, max_rows, hidden) for b in bufs]
    g = torch.Generator().manual_seed(1)
    x = [(torch.randn(rows, hidden, generator=g) * 30).half() for _ in range(world)]
    x[2][1, 3] = float("nan")
    res, w = torch.randn(rows, hidden, generator=g).half(), torch.randn(hidden, generator=g).half()
    got = []
    for r in range(world):
        for p in range(world):  # peers' rows the kernel will wait for (a peer run later has not stored yet)
            if p > r:
                slots[r][p, :rows] = x[p] + 0.0
        f = _rank(r, bufs, hidden, max_rows, 0)
        f.world, f.site_numel, f.peers = world, span, bufs + [bufs[0]] * (fa.MAX_WORLD - world)
        got.append(f(x[r], w, 1e-5, False, res))
        for p in range(world):
            if p != r:
                assert (slots[r][p, :rows].view(torch.int16) == fa.EMPTY).all()  # read and emptied
    total = ((x[0].float() + x[1].float()) + x[2].float()).half()
    want = rms_norm(total, w, 1e-5, False, res)
    for out, h in got:
        assert torch.equal(h.view(torch.int16), want[1].view(torch.int16))
        assert torch.equal(out[0].view(torch.int16), want[0][0].view(torch.int16))
        assert torch.isnan(out[1]).all()  # the NaN reaches the whole row's norm, as with NCCL


def test_the_exchange_buffer_is_capped() -> None:
    """Rows shrink so that block ends x TP x rows x hidden stays under the cap: the 8B preset at TP 2 keeps batch
    64 fused; a 56B-class model at TP 8 gets fewer rows rather than gigabytes taken from the cache."""
    cap = fa.DEFAULT_MAX_EXCHANGE_MIB << 20
    assert fa.rows_that_fit(64, 53, 2, 4096, torch.bfloat16) == 64
    assert fa.rows_that_fit(256, 53, 2, 4096, torch.bfloat16) == cap // (53 * 2 * 4096 * 2) == 154
    rows = fa.rows_that_fit(256, 118, 8, 8192, torch.bfloat16)
    assert 0 < rows < 16 and rows * 118 * 8 * 8192 * 2 <= cap
