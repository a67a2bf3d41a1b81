"""Rank 0's watch over its followers (engine.parallel.executor.Followers._watch) against a scripted clock: a
follower counts as frozen only when it is seen stopped (process state T) for FROZEN_RANK_S of rank 0's own
watching. Rank 0 stopped too (a whole worker stopped and continued by job control or an operator) sees the time
jump: a follower seen stopped just before and just after must not count as frozen for the whole gap, since it was
continued with rank 0. A follower never stopped (a GC pause, a compile, a slow host: states R, S or D) is never
frozen however long it takes; one stopped for FROZEN_RANK_S of polls is."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hybridpd.engine.parallel import executor


class Proc:
    pid, returncode = 4242, None

    def poll(self) -> None:
        return None


def _watch(monkeypatch: pytest.MonkeyPatch, times: list[float], stopped: list[bool]) -> str | None:
    """Run _watch over the scripted polls; the reason it failed the worker, or None."""
    f = object.__new__(executor.Followers)
    f.procs, f.closing = [Proc()], False  # type: ignore[list-item]
    failed: list[str] = []
    clock: Iterator[float] = iter(times)
    states = iter(stopped)

    def fail(exc: object) -> None:
        failed.append(str(exc))
        f.closing = True

    def sleep(_s: float) -> None:
        if len(failed) == 0 and not f.closing:
            try:
                next_time[0] = next(clock)
            except StopIteration:
                f.closing = True

    next_time = [next(clock)]
    monkeypatch.setattr(f, "fail", fail)
    monkeypatch.setattr(executor.time, "monotonic", lambda: next_time[0])
    monkeypatch.setattr(executor.time, "sleep", sleep)
    monkeypatch.setattr(executor, "_stopped", lambda pid: next(states, False))
    f._watch()
    return failed[0] if failed else None


def test_rank_zero_stopped_with_its_follower_is_no_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    times = [0.0, 600.0, 600.2, 600.4]  # rank 0 itself stopped for ten minutes between two polls
    assert _watch(monkeypatch, times, [True, True, False, False]) is None


def test_a_long_busy_follower_is_never_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    times = [0.2 * i for i in range(200)]  # 40 s of polls, never in state T
    assert _watch(monkeypatch, times, [False] * 200) is None


def test_a_follower_stopped_for_frozen_rank_s_is_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    n = round(executor.FROZEN_RANK_S / executor.WATCH_POLL_S) + 1
    times = [0.2 * i for i in range(n + 5)]
    reason = _watch(monkeypatch, times, [True] * (n + 5))
    assert reason is not None and "frozen" in reason
    short = _watch(monkeypatch, times[: n - 1], [True] * (n - 1))  # stopped a poll short of it: not yet
    assert short is None
