"""A Prefill whose caller gave up (cancelled the RPC) just as the prefill worker answered: the answer, with its lease
token, never reached the caller, so the caller's Release (by request id, without the token) cannot end the lease,
and the prompt's pages stayed pinned until the lease expired (30 s by default: a disconnect storm during prefills
filled P's pinned share and it answered RESOURCE_EXHAUSTED meanwhile). The prefill worker now ends a lease itself
when the RPC that would have carried it ends cancelled; one whose answer was delivered keeps it for D's pull."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.core import EngineCore
from hybridpd.engine.default_model import default_model_path
from hybridpd.prefill.service import PrefillServicer
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.worker.context import WorkerContext

from tests.support.pd_pair import engine_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Context:
    """The ServicerContext surface Prefill uses; the RPC ends (done callbacks) when the test says so."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []
        self.was_cancelled = False

    def add_done_callback(self, cb: Callable[[Any], None]) -> None:
        self.callbacks.append(cb)

    def cancelled(self) -> bool:
        return self.was_cancelled

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")

    def end(self, cancelled: bool) -> None:
        self.was_cancelled = cancelled
        for cb in self.callbacks:
            cb(self)


def test_a_lease_whose_answer_was_cancelled_in_flight_is_released_by_the_prefill_worker() -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineCore(engine_config(default_model_path())))
        p = PrefillServicer(WorkerContext(role="prefill", aengine=engine, model_name="m", address="p:1"))
        try:
            sp = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            for rid, cancelled in (("kept", False), ("gone", True)):
                ctx = _Context()
                resp = await p.Prefill(
                    pb.PrefillRequest(request_id=rid, prompt_token_ids=list(range(1, 40)), sampling_params=sp), ctx
                )  # type: ignore[arg-type]
                assert resp.params.lease_token and rid in p.leases
                ctx.end(cancelled)  # the RPC ends: delivered, or cancelled by its caller as the answer left
            for _ in range(100):
                if "gone" not in p.leases:
                    break
                await asyncio.sleep(0.02)
            assert "gone" not in p.leases and "kept" in p.leases  # D may still pull the delivered one
            stats = await p.Stats(pb.StatsRequest(), None)
            assert stats.leases_pinned == 1
        finally:
            engine.shutdown()

    asyncio.run(scenario())
