"""A worker whose engine's step thread is stuck in one step (a hung kernel, a deadlock) while its gRPC server still
answers: `AsyncEngine.busy_for()` grows, and past the worker's stall timeout its Health answers not ready (the
proxy then routes around it and gives up the streams waiting on it: test_proxy_failures). Idle, a worker is ready
however long it has been idle."""

from __future__ import annotations

import asyncio
import threading
import time

from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.worker.context import WorkerContext, WorkerRpcs

from tests.polling import wait_for


class _StuckCore:
    """The EngineCore surface AsyncEngine drives; `step()` blocks until `release` is set once `work` is."""

    def __init__(self) -> None:
        self.finish_listeners: list = []
        self.work = threading.Event()
        self.release = threading.Event()

    def has_unfinished(self) -> bool:
        return self.work.is_set() and not self.release.is_set()

    def is_stalled(self) -> bool:
        return False

    def step(self) -> list:
        self.release.wait(30)
        return []

    def shutdown(self) -> None:
        pass


def _health(ctx: WorkerContext) -> bool:
    rpcs = WorkerRpcs()
    rpcs.ctx = ctx
    return asyncio.run(rpcs.Health(None, None)).ready  # type: ignore[attr-defined]


def test_health_says_not_ready_while_the_engine_is_stuck_in_one_step() -> None:
    core = _StuckCore()
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    ctx = WorkerContext(role="decode", aengine=engine, model_name="m", address="d:1", stall_timeout_s=0.3)
    try:
        time.sleep(0.5)  # idle longer than the stall timeout: still ready
        assert engine.busy_for() == 0.0 and _health(ctx)
        core.work.set()
        engine.call(lambda c: None)  # wake the step thread: it enters a step that hangs
        wait_for("the step thread stuck past the timeout", lambda: engine.busy_for() > 0.3, timeout=5, interval=0.02)
        assert not _health(ctx)
        ctx.stall_timeout_s = 0  # the check off: ready whatever the engine does
        assert _health(ctx)
        ctx.stall_timeout_s = 0.3
        core.release.set()  # the step returns: ready again
        wait_for("the step thread back to its wait", lambda: engine.busy_for() == 0.0, timeout=5, interval=0.02)
        assert _health(ctx)
    finally:
        core.release.set()
        engine.shutdown()
