"""AsyncEngine's idle step thread: no wake-ups when nothing needs polling, back-off for hooks that never declared
when they need polling, hot polling while a hook owner asks for it (the decode worker's 100 us pull polling)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hybridpd.engine.async_engine import AsyncEngine


class IdleCore:
    """Stands in for an EngineCore with nothing to run."""

    def __init__(self) -> None:
        self.finish_listeners: list = []

    def has_unfinished(self) -> bool:
        return False

    def is_stalled(self) -> bool:
        return False


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    e = AsyncEngine(IdleCore())  # type: ignore[arg-type]
    yield e
    e.shutdown()


def counting_hook(counter: list[float]):  # type: ignore[no-untyped-def]
    return lambda core: counter.append(time.monotonic())


def test_idle_without_hooks_sleeps_until_called(engine: AsyncEngine) -> None:
    time.sleep(0.1)
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.05  # the whole process, idle step thread included
    assert engine.call(lambda core: 42).result(1) == 42


def test_declared_hook_runs_only_when_it_needs_polling_or_on_calls(engine: AsyncEngine) -> None:
    runs: list[float] = []
    busy = [False]
    engine.add_hook(counting_hook(runs), needs_poll=lambda: busy[0])
    engine.call(lambda core: None).result(1)
    time.sleep(0.5)
    quiet = len(runs)
    assert quiet <= 2
    busy[0] = True
    engine.call(lambda core: None).result(1)
    time.sleep(0.3)
    assert len(runs) - quiet >= 20  # every idle_wait() (5 ms) while it needs polling


def test_undeclared_hook_backs_off_and_hot_polling_still_works(engine: AsyncEngine) -> None:
    runs: list[float] = []
    engine.hooks.append(counting_hook(runs))
    engine.call(lambda core: None).result(1)
    time.sleep(1.5)
    assert 3 <= len(runs) <= 20  # 5, 10, 20, ... 500 ms apart (was 300 runs at a fixed 5 ms)
    pulling = [True]
    engine.idle_wait = lambda: 1e-4 if pulling[0] else 0.005
    engine.call(lambda core: None).result(1)
    before = len(runs)
    time.sleep(0.3)
    assert len(runs) - before >= 100  # 100 us polling while a pull is in flight
