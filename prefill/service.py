"""PrefillService: run a prompt to N-1 tokens, pin its caches under a lease, return transfer params.

Threads: gRPC handlers run on the asyncio loop; everything touching the engine runs on the step thread
(`AsyncEngine.call` / hooks / on_finished callbacks)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from engine.core import EngineCore
from engine.request import Request
from kvtransfer.metrics import TransferMetrics
from prefill.leases import Lease, LeaseTable
from proto import hybridpd_pb2 as pb
from proto import hybridpd_pb2_grpc as pb_grpc
from worker.context import WorkerContext, health_response, run_engine_call, transfer_metadata
from worker.convert import sampling_params_from_proto, stats_response

log = logging.getLogger("hybridpd.prefill")


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, ctx: WorkerContext, lease_seconds: float = 30.0) -> None:
        self.ctx = ctx
        self.leases = LeaseTable(self._free_lease, lease_seconds)
        self.tmetrics = TransferMetrics("prefill")
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        ctx.aengine.on_finished.append(self._on_finished)
        ctx.aengine.hooks.append(self._hook)

    # -- step thread -----------------------------------------------------------------------------------------------
    def _free_lease(self, lease: Lease) -> None:
        core: EngineCore = self.ctx.core
        core.scheduler.release(lease.request)
        if lease.checkpoint_slot is not None and core.cache.recurrent is not None:
            core.cache.recurrent.pool.free([lease.checkpoint_slot])

    def _hook(self, core: EngineCore) -> None:
        expired = self.leases.reap()
        if expired:
            log.warning("lease expired for %d prefilled request(s): freed without a pull", len(expired))
            self.tmetrics.leases_expired(len(expired))
        if self.ctx.agent is not None:
            for notice in self.ctx.agent.poll_releases():
                if notice.epoch in ("", self.ctx.epoch):
                    self.leases.release(notice.request_id)
        if self.ctx.metrics is not None:
            self.ctx.metrics.update(core)

    def _on_finished(self, req: Request) -> None:
        waiter = self._waiters.pop(req.request_id, None)
        if req.finish_reason != "prefilled":
            if waiter is not None:
                loop, fut = waiter
                loop.call_soon_threadsafe(_set_exc, fut, RuntimeError(f"prefill ended: {req.finish_reason}"))
            return
        core: EngineCore = self.ctx.core
        ckpt_tokens, ckpt_slot = 0, None
        if core.cache.recurrent is not None and core.cache.enable_prefix_caching:
            ckpt_tokens, ckpt_slot = core.cache.recurrent.find_hit(req.block_hashes, req.num_computed_tokens)
            if ckpt_slot is not None:
                core.cache.recurrent.pool.touch([ckpt_slot])
        lease = self.leases.pin(req, ckpt_slot, ckpt_tokens)
        if waiter is None:  # the caller went away: nobody will pull
            self.leases.release(req.request_id)
            return
        bs = core.cache.block_size
        n = req.num_computed_tokens
        groups = []
        if core.cache.attention is not None:
            blocks = core.cache.block_ids(req.request_id)[: -(-n // bs)]
            groups.append(pb.GroupBlocks(group_id=core.cache.attention.group.group_id, block_ids=blocks))
        params = pb.TransferParams(
            worker_id=self.ctx.worker_id, epoch=self.ctx.epoch, prefill_address=self.ctx.address, groups=groups,
            state_slot=max(core.cache.state_slot(req.request_id), 0), num_computed_tokens=n,
            num_prompt_tokens=req.num_prompt_tokens, lease_expiry_unix=lease.expiry,
            checkpoint_slot=ckpt_slot or 0, checkpoint_num_tokens=ckpt_tokens if ckpt_slot else 0,
        )
        resp = pb.PrefillResponse(request_id=req.request_id, params=params,
                                  num_cached_tokens=max(req.num_cached_tokens, 0))
        loop, fut = waiter
        loop.call_soon_threadsafe(_set_result, fut, resp)

    # -- RPCs --------------------------------------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        rid = request.request_id
        prompt = [int(t) for t in request.prompt_token_ids]
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await run_engine_call(self.ctx, context, lambda c: c.validate_prompt(prompt))
        target = len(prompt) - 1
        if target < 1:
            # nothing to compute: D computes the single prompt token itself
            return pb.PrefillResponse(request_id=rid, params=pb.TransferParams(
                worker_id=self.ctx.worker_id, epoch=self.ctx.epoch, prefill_address=self.ctx.address,
                num_computed_tokens=0, num_prompt_tokens=len(prompt)))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiters[rid] = (loop, fut)
        salt = request.cache_salt or None
        try:
            await run_engine_call(
                self.ctx, context, lambda c: c.add_request(rid, prompt, params, salt, compute_target=target))
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(rid, None)
            self.ctx.aengine.call(lambda c: (c.abort(rid), self.leases.release(rid)))
            raise
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
            raise

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        if request.epoch and request.epoch != self.ctx.epoch:
            return pb.ReleaseResponse(released=False)
        released = await self.ctx.aengine.acall(lambda c: self.leases.release(request.request_id))
        return pb.ReleaseResponse(released=bool(released))

    async def GetTransferMetadata(self, request, context):  # type: ignore[no-untyped-def]
        return transfer_metadata(self.ctx)

    async def Health(self, request, context):  # type: ignore[no-untyped-def]
        return health_response(self.ctx)

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        def stats(core: EngineCore) -> pb.StatsResponse:
            pinned: dict[int, int] = {}
            if core.cache.attention is not None:
                gid = core.cache.attention.group.group_id
                pinned[gid] = len({b for lease in self.leases.leases.values()
                                   for b in core.cache.block_ids(lease.request.request_id)})
            return stats_response(core, "prefill", self.ctx.worker_id, self.ctx.epoch, self.ctx.metrics_port,
                                  pinned, len(self.leases))
        return await self.ctx.aengine.acall(stats)


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
