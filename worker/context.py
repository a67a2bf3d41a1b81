"""What a worker process holds: the engine on its step thread, its identity, its transfer agent and metrics."""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.metrics import WorkerMetrics
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.proto import hybridpd_pb2 as pb

log = logging.getLogger("hybridpd.worker")


@dataclass
class WorkerContext:
    role: str
    aengine: AsyncEngine
    model_name: str
    address: str
    metrics_port: int = 0
    agent: Any = None
    """hybridpd.kvtransfer.agent.TransferAgent, or None when transfers are off (colocated)."""
    metrics: WorkerMetrics | None = None
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    cluster_token: str | None = None
    """Shared secret of the cluster (worker.auth): required on this worker's RPCs, sent on its calls to peers,
    and the key of the membership proof in GetTransferMetadata. None: an open development cluster."""
    draining: bool = False
    """Set by the Drain RPC: proxies route no new requests here (worker/announce.py reports it)."""
    cache_event_hub: Any = None
    """hybridpd.worker.cache_events.CacheEventHub, made by the first `CacheEvents` subscriber."""
    tls: Any = None
    """hybridpd.worker.auth.TlsFiles when worker gRPC runs over TLS (for this worker's calls to its peers too)."""
    tp_layout: Any = None
    """hybridpd.kvtransfer.tp_handshake.TPLayout: every rank's agent and cache slicing (None when transfers are off)."""
    stall_timeout_s: float = 300.0
    """Health answers not ready while the engine's step thread has been in one pass (a step, a hook) for longer
    than this: wedged, though this gRPC server still answers. Proxies route around it and give up the streams
    waiting on it (proxy/cluster_view.py). 0: never."""

    stall_reported: bool = False
    """Health last answered not ready for a stuck engine (logged once per stall)."""

    def engine_stalled(self) -> bool:
        return self.stall_timeout_s > 0 and self.aengine.busy_for() > self.stall_timeout_s

    @property
    def core(self):  # type: ignore[no-untyped-def]
        return self.aengine.core


async def abort_invalid(context: grpc.aio.ServicerContext, e: Exception) -> None:
    code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, (InvalidRequestError, ValueError)) else \
        grpc.StatusCode.INTERNAL
    await context.abort(code, str(e))


_GRAMMAR_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
"""Structured-output grammars compile here, never on the engine's step thread (`precompile_structured`)."""


async def precompile_structured(ctx: WorkerContext, context: grpc.aio.ServicerContext, params: SamplingParams) -> None:
    """Compile the request's grammar (if any) on a helper thread, before the request reaches the step thread, where
    `EngineCore.new_request` then finds it in the grammar cache. A schema can take seconds to compile (a JSON schema
    nested a few hundred levels deep: 3 s at 400 on one CPU core, growing with the cube of the depth), and compiled
    on the step thread it paused every request of the worker for that long; xgrammar releases the GIL while it
    compiles. A malformed spec is an INVALID_ARGUMENT naming the problem, as from `new_request`."""
    spec = params.structured
    if spec is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(_GRAMMAR_POOL, ctx.core.structured.check, spec)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001
        await abort_invalid(context, e)


async def run_engine_call(ctx: WorkerContext, context: grpc.aio.ServicerContext, fn):  # type: ignore[no-untyped-def]
    """Run fn(core) on the step thread; map bad input to INVALID_ARGUMENT."""
    try:
        return await ctx.aengine.acall(fn)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001
        await abort_invalid(context, e)


class WorkerRpcs:
    """The RPCs prefill and decode servicers answer alike (mixed in ahead of the generated servicer base)."""

    ctx: WorkerContext

    async def GetTransferMetadata(self, request, context) -> pb.TransferMetadata:  # type: ignore[no-untyped-def]
        from hybridpd.kvtransfer.binding import membership_proof

        agent, ctx = self.ctx.agent, self.ctx
        meta = agent.local_metadata() if agent is not None else b""
        tp_layout = ctx.tp_layout.encode() if ctx.tp_layout is not None else b""
        proof = membership_proof(ctx.cluster_token, request.nonce, ctx.worker_id, ctx.epoch, meta + tp_layout) \
            if ctx.cluster_token and request.nonce else b""
        return pb.TransferMetadata(
            agent_metadata=meta, worker_id=ctx.worker_id, epoch=ctx.epoch,
            compat_hash=agent.layout.compat_hash if agent is not None else "", proof=proof, tp_layout=tp_layout,
        )

    async def Health(self, request, context) -> pb.HealthResponse:  # type: ignore[no-untyped-def]
        stalled = self.ctx.engine_stalled()
        if stalled != self.ctx.stall_reported:  # logged when it starts and ends, not at every probe
            self.ctx.stall_reported = stalled
            if stalled:
                log.warning("Health: not ready, the engine's step thread has been in one pass for %.0f s",
                            self.ctx.aengine.busy_for())
            else:
                log.warning("Health: ready again, the engine's step thread is back")
        return pb.HealthResponse(role=self.ctx.role, model=self.ctx.model_name, epoch=self.ctx.epoch, ready=not stalled,
                                 worker_id=self.ctx.worker_id, draining=self.ctx.draining)

    async def Drain(self, request, context) -> pb.DrainResponse:  # type: ignore[no-untyped-def]
        """Mark this worker drained (or not): its registrations and Health tell every proxy."""
        self.ctx.draining = request.drain
        return pb.DrainResponse(draining=self.ctx.draining)

    async def CacheEvents(self, request, context):  # type: ignore[no-untyped-def]
        """The cache-event stream (worker/cache_events.py): one hub per worker, shared by every subscriber."""
        from hybridpd.worker.cache_events import CacheEventHub

        hub = getattr(self.ctx, "cache_event_hub", None)
        if hub is None:
            hub = self.ctx.cache_event_hub = CacheEventHub(self.ctx)
        async for batch in hub.stream():
            yield batch
