"""The scattered-checkpoint benchmark's copies round-trip a state (CPU, tiny arena): a checkpoint written out as k
page-sized pieces to random pages and gathered back into another slot has the written bytes, in every view."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import cache_checkpoint_pages as ccp


def test_scattered_checkpoint_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ccp.json"
    args = "--device cpu --state-layers 1 --arena-gib 0.03 --running-slots 6 --batch 1 3 --repeats 1 --warmup 0"
    argv = ["ccp", *args.split(), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    ccp.main()
    report = json.loads(out.read_text())
    assert report["k"] == -(-report["state_bytes"] // ccp.PAGE_BYTES) == 9
    assert [r["batch"] for r in report["rows"]] == [1, 3]


def test_a_wrong_page_is_caught() -> None:
    """The check fails when the restore reads the pages in another order than they were written (it can fail)."""
    import torch

    arena = ccp.Arena(1, int(0.03 * 2**30), 6, torch.device("cpu"), 2)
    gen = torch.Generator().manual_seed(0)
    ccp.check(arena, 2, gen)
    real = ccp.copy_units
    calls = []

    def shifted(units: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        calls.append(1)
        real(units, src.roll(1) if len(calls) == 2 else src, dst)  # pieces out of order

    ccp.copy_units = shifted  # type: ignore[assignment]
    try:
        with pytest.raises(AssertionError):
            ccp.check(arena, 2, gen)
    finally:
        ccp.copy_units = real  # type: ignore[assignment]
