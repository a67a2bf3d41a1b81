"""Building the fused TP block end (engine.parallel.fused_allreduce.build) when a rank's local part fails: every
rank must make the same collective calls in the same order and all must fall back to NCCL. The buffer's
allocation and the peers' mapping can fail on one rank alone (its GPU out of memory, no peer access from it);
a rank that went on into the symmetric-memory rendezvous or the NCCL barrier would wait there for a peer that is
already in the next collective (start-up hangs for the group's timeout, then fails). Two ranks are played in one
process against fakes of symmetric memory, the barrier and the control group's agree_min (each rank's calls are
recorded; agree_min answers the minimum over the two ranks' values, from a replay of the other rank's calls)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

if not any(m in sys.modules for m in ("hybridpd.engine.kernels.fused", "hybridpd.engine.parallel.fused_allreduce")):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton loads, as the kernel tests want it (else they skip)
pytest.importorskip("triton")

import torch  # noqa: E402
from hybridpd.engine.parallel import fused_allreduce as fa  # noqa: E402
from hybridpd.engine.parallel.group import BlockReduce  # noqa: E402


class FakeTP:
    """One rank's group: agree_min takes the minimum with the other rank's value at the same call (scripted)."""

    def __init__(self, rank: int, peer_values: list[int], calls: list[str]) -> None:
        self.rank, self.world = rank, 2
        self.group = type("G", (), {"group_name": "0"})()
        self.block_reduce = BlockReduce()
        self.peer_values, self.calls = list(peer_values), calls
        self.values: list[int] = []

    def agree_min(self, value: int) -> int:
        self.calls.append("agree_min")
        self.values.append(value)
        return min(value, self.peer_values.pop(0)) if self.peer_values else value


class Model:
    block_ends, hidden_size = 3, 16


def _fake_memory(monkeypatch: pytest.MonkeyPatch, calls: list[str], fail: str | None) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    def empty(numel: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
        calls.append("empty")
        if fail == "empty":
            raise torch.OutOfMemoryError("CUDA out of memory (this rank's GPU only)")
        return torch.empty(numel, dtype=dtype)

    class Handle:
        def get_buffer(self, p: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if fail == "map":
                raise RuntimeError("no peer access from this GPU")
            return torch.empty(shape, dtype=dtype)

    def rendezvous(buffer: torch.Tensor, group_name: str) -> Handle:
        calls.append("rendezvous")
        return Handle()

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(dist, "barrier", lambda group=None: calls.append("barrier"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def _build(
    monkeypatch: pytest.MonkeyPatch, rank: int, fail: str | None, peer_values: list[int]
) -> tuple[int, FakeTP, list[str]]:
    calls: list[str] = []
    with monkeypatch.context() as m:
        _fake_memory(m, calls, fail)
        tp = FakeTP(rank, peer_values, calls)
        got = fa.build(tp, Model(), torch.device("cuda", rank), torch.bfloat16, 4)
    return got, tp, calls


def _collectives(calls: list[str]) -> list[str]:
    return [c for c in calls if c != "empty"]


@pytest.mark.parametrize("fail", ["empty", "map"])
def test_one_rank_failing_locally_leaves_every_rank_in_step(monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    got1, tp1, calls1 = _build(monkeypatch, 1, fail, [])  # rank 1 fails; its agree values as if alone
    got0, tp0, calls0 = _build(monkeypatch, 0, None, tp1.values)  # rank 0 meets rank 1's values
    assert _collectives(calls0) == _collectives(calls1)  # same collectives, same order: nobody waits alone
    assert got0 == got1 == 0 and tp0.block_reduce.fused is None and tp1.block_reduce.fused is None
    assert "barrier" not in calls0


def test_every_rank_succeeding_fuses(monkeypatch: pytest.MonkeyPatch) -> None:
    got1, tp1, calls1 = _build(monkeypatch, 1, None, [])
    got0, tp0, calls0 = _build(monkeypatch, 0, None, tp1.values)
    assert _collectives(calls0) == _collectives(calls1)
    assert calls0.count("rendezvous") == calls0.count("barrier") == 1
    assert got0 == got1 == tp0.block_reduce.fused.nbytes > 0
