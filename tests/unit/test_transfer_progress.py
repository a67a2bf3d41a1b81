"""A READ that needs the target's progress must not wait for the target's engine steps.

Workers run without NIXL's own progress thread, and before kvtransfer/progress.py the step loop was the only thing
that progressed a worker's agent: once per engine step while the engine was busy. Over a transport that needs both
sides to progress (UCX over TCP), a pull then moved one slice per P step and per D step, so a handoff's time grew
with the recurrent state's size (benchmarks/pd_handoff.py: 2.5 s per 34 MB pull on CPU over TCP, 0.6 s with the
thread). These tests count progress calls, not seconds: a READ of many slices must complete while P's step thread
is blocked in one long step, and the thread must stop polling once nothing is in flight.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.core import EngineCore
from hybridpd.kvtransfer.notify import ReleaseNotice
from hybridpd.kvtransfer.progress import TransferProgress
from hybridpd.prefill.service import PrefillServicer
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.worker.context import WorkerContext

from tests.oracle import random_prompts
from tests.support.pd_pair import FakeContext
from tests.support.pd_pair import engine_config as _config
from tests.unit.test_pd_handoff import MODEL

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class _Config:
    progress_thread: bool = False


@dataclass
class TcpLikeAgent:
    """Stands in for a TransferAgent whose READs advance only while this side progresses (one slice per
    progress call, as UCX over TCP serves a READ on the target). `poll_releases` is the progress call."""

    config: _Config = field(default_factory=_Config)
    layout: Any = field(default_factory=lambda: SimpleNamespace(device_type="cpu"))
    slices_left: int = 0
    polls: int = 0
    notices: list[ReleaseNotice] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def poll_releases(self) -> list[ReleaseNotice]:
        with self.lock:
            self.polls += 1
            if self.slices_left:
                self.slices_left -= 1
            out, self.notices = self.notices, []
            return out


def _wait_for(pred, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def test_progress_thread_polls_only_while_active_and_hands_notices_over() -> None:
    active = threading.Event()
    polled, got = [], []
    prog = TransferProgress(lambda: polled.append(1) or ["n"], active.is_set, on_notices=got.extend,
                            interval_s=1e-4)
    try:
        time.sleep(0.05)
        assert not polled  # nothing in flight: no polling at all
        active.set()
        prog.wake()
        assert _wait_for(lambda: len(polled) >= 50)
        assert got and set(got) == {"n"}
        active.clear()
        assert _wait_for(lambda: prog.num_polls == len(polled))
        time.sleep(0.05)  # let a poll already past its check finish
        n = len(polled)
        time.sleep(0.2)
        assert len(polled) <= n + 1  # idle again: it sleeps on its event
    finally:
        prog.stop()


def test_the_thread_is_on_for_dram_caches_and_off_for_vram_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200 a decode worker progressed outside its step thread aborted inside UCX (kvtransfer/progress.py):
    VRAM agents get no thread by default; the variable still sets it (or turns it off) explicitly."""
    from hybridpd.kvtransfer.progress import DEFAULT_INTERVAL_S, interval_from_env

    monkeypatch.delenv("HYBRIDPD_TRANSFER_PROGRESS_S", raising=False)
    assert interval_from_env("cpu") == DEFAULT_INTERVAL_S
    assert interval_from_env("cuda") is None
    monkeypatch.setenv("HYBRIDPD_TRANSFER_PROGRESS_S", "0.001")
    assert interval_from_env("cuda") == 0.001
    monkeypatch.setenv("HYBRIDPD_TRANSFER_PROGRESS_S", "0")
    assert interval_from_env("cpu") is None


def test_a_prefill_worker_on_a_gpu_cache_starts_no_progress_thread(checkpoint_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("HYBRIDPD_TRANSFER_PROGRESS_S", raising=False)
    agent = TcpLikeAgent(layout=SimpleNamespace(device_type="cuda"))
    core = EngineCore(_config(checkpoint_dir(MODEL)))
    ctx = WorkerContext(role="prefill", aengine=AsyncEngine(core), model_name="m", address="p:1", agent=agent)
    try:
        assert PrefillServicer(ctx).progress is None
    finally:
        ctx.aengine.shutdown()


def test_a_read_needing_p_progress_completes_while_p_is_stuck_in_one_step(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """P holds a lease, its step thread is busy (one long step), and D's READ needs 300 P-side progress calls:
    it must complete without a single engine step on P; the release notice D then sends ends the lease."""
    agent = TcpLikeAgent()
    core = EngineCore(_config(checkpoint_dir(MODEL)))
    ctx = WorkerContext(role="prefill", aengine=AsyncEngine(core), model_name="m", address="p:1", agent=agent)
    p = PrefillServicer(ctx)
    try:
        assert p.progress is not None
        prompt = random_prompts([40], vocab=256, seed=1)[0]
        sp = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        resp = asyncio.run(p.Prefill(pb.PrefillRequest(request_id="r", prompt_token_ids=prompt, sampling_params=sp),
                                     FakeContext()))  # type: ignore[arg-type]
        assert len(p.leases) == 1
        gate, in_step = threading.Event(), threading.Event()
        ctx.aengine.call(lambda c: (in_step.set(), gate.wait(30)))  # the step thread is stuck from here on
        assert in_step.wait(10)
        with agent.lock:
            agent.slices_left = 300
        try:
            assert _wait_for(lambda: agent.slices_left == 0), (
                f"{agent.slices_left} of 300 slices left: the READ waited for P's engine steps")
            assert not gate.is_set()
            with agent.lock:
                agent.notices.append(ReleaseNotice("r", ctx.epoch, True, resp.params.lease_token))
        finally:
            gate.set()
        assert _wait_for(lambda: len(p.leases) == 0 and not p.held)  # the notice went to the step thread
        polls = agent.polls
        time.sleep(0.2)
        assert agent.polls <= polls + 2  # no lease held: the thread went idle
    finally:
        p.progress.stop()  # type: ignore[union-attr]
        ctx.aengine.shutdown()
