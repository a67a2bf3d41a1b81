"""An in-process P/D pair for handoff tests, without NIXL: the real PrefillServicer and DecodeServicer over two
EngineCores of the same model, a fake pull that copies pages between their cache tensors, and D's Commit answered
by P's servicer directly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import hybridpd.decode.consumer as consumer_mod
import pytest
import torch
from hybridpd.decode.service import DecodeServicer
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig
from hybridpd.engine.core import EngineCore
from hybridpd.kvtransfer.pull import PullResult, PullState
from hybridpd.prefill.service import PrefillServicer
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.worker.context import WorkerContext


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class FakeContext:
    """A servicer context for direct calls: the RPC never ends cancelled (its answer is always delivered)."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def add_done_callback(self, callback: object) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def engine_config(model: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=model, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, checkpoint_interval=32, kv_cache_memory_bytes=8 * 2**20),
    )


@dataclass
class FakeHandle:
    """A pull that copies P's pages into D's on its first poll. `during_read` runs just before the copy (a fault
    injected while the READ is in flight)."""

    p: EngineCore
    d: EngineCore
    spec: Any
    during_read: Callable[[], None] | None = None
    result: PullResult | None = None

    def poll(self) -> PullState:
        if self.result is None:
            if self.during_read is not None:
                self.during_read()
            for maps_src, maps_dst in (
                (self.spec.src_blocks, self.spec.dst_blocks),
                (self.spec.src_state_slots, self.spec.dst_state_slots),
            ):
                for gid, src in maps_src.items():
                    src_t = torch.tensor(list(src), dtype=torch.long)
                    dst_t = torch.tensor(list(maps_dst[gid]), dtype=torch.long)
                    for ps, ds in zip(self.p.runner.group_tensors[gid], self.d.runner.group_tensors[gid], strict=True):
                        ds.index_copy_(0, dst_t, ps.index_select(0, src_t))
            self.result = PullResult(self.spec.request_id, PullState.DONE, "recompute", 0, 0, 0.0)
        return self.result.state

    def cancel(self) -> None:
        pass


class DirectStub:
    """D's view of P's gRPC service, answered by P's servicer in process (or failing like an unreachable P)."""

    def __init__(self, servicer: PrefillServicer, down: bool = False) -> None:
        self.servicer, self.down = servicer, down

    async def Commit(self, req: pb.CommitRequest, timeout: float, metadata: Any) -> pb.CommitResponse:
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
        return await self.servicer.Commit(req, FakeContext())  # type: ignore[arg-type]


@dataclass
class Pair:
    p_core: EngineCore
    d_core: EngineCore
    p: PrefillServicer
    d: DecodeServicer
    during_read: Callable[[], None] | None = None
    p_down: bool = False
    pulls: list[Any] = field(default_factory=list)

    def close(self) -> None:
        self.p.ctx.aengine.shutdown()
        self.d.ctx.aengine.shutdown()


async def make_pair(
    model: str, monkeypatch: pytest.MonkeyPatch, lease_seconds: float = 30.0, max_pinned_fraction: float = 0.5,
    p_config: EngineConfig | None = None, d_config: EngineConfig | None = None,
) -> Pair:
    """`p_config` / `d_config`: each side's engine (default: `engine_config(model)`)."""
    p_core = EngineCore(p_config or engine_config(model))
    d_core = EngineCore(d_config or engine_config(model))
    p_ctx = WorkerContext(role="prefill", aengine=AsyncEngine(p_core), model_name="m", address="p:1")
    d_ctx = WorkerContext(role="decode", aengine=AsyncEngine(d_core), model_name="m", address="d:1")
    p = PrefillServicer(p_ctx, lease_seconds, max_pinned_fraction)
    d = DecodeServicer(d_ctx)
    pair = Pair(p_core, d_core, p, d)

    def fake_start_pull(peer: Any, spec: Any, **kw: Any) -> FakeHandle:
        assert spec.notify_done is False and spec.lease_token  # D ends the lease by Commit, never by a notice
        pair.pulls.append(spec)
        return FakeHandle(p_core, d_core, spec, pair.during_read)

    async def fake_peer(tp: pb.TransferParams) -> object:
        return object()

    monkeypatch.setattr(consumer_mod, "start_pull", fake_start_pull)
    monkeypatch.setattr(d, "_peer", fake_peer)
    monkeypatch.setattr(d, "_prefill_stub", lambda address: DirectStub(p, pair.p_down))
    return pair


COLOCATED_FIRST: dict[tuple[int, ...], int] = {}
"""prompt -> the colocated engine's first greedy output token (the tests' `expected` fixtures fill it): what the
proxy would hand D with P's params."""
