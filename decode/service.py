"""DecodeService: Generate (server stream), Abort, GetTransferMetadata, Health, Stats.

Threads: handlers run on the asyncio loop; engine work runs on the step thread via `AsyncEngine.call` and the
step hook (pull polling, metrics)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from decode.consumer import Consumer
from engine.core import EngineCore
from proto import hybridpd_pb2 as pb
from proto import hybridpd_pb2_grpc as pb_grpc
from worker.context import WorkerContext, WorkerRpcs, run_engine_call
from worker.convert import sampling_params_from_proto, stats_response

log = logging.getLogger("hybridpd.decode")


class DecodeServicer(WorkerRpcs, pb_grpc.DecodeServiceServicer):
    def __init__(self, ctx: WorkerContext, policy: str = "recompute", pull_timeout_s: float = 10.0) -> None:
        self.ctx = ctx
        self.consumer = Consumer(policy, pull_timeout_s)
        self._peers: dict[tuple[str, str], object] = {}
        self._peer_lock = asyncio.Lock()
        self._metrics_at = 0.0
        ctx.aengine.hooks.append(self._hook)
        # while a pull is in flight and nothing else runs, poll it every 100 us rather than every 5 ms: an idle
        # decode worker then sees the KV land within 0.1 ms (docs/BENCHMARKS.md, KV transfer)
        ctx.aengine.idle_wait = lambda: 1e-4 if self.consumer.pending else 0.005

    def _hook(self, core: EngineCore) -> None:
        self.consumer.poll(core)
        while self.consumer.failed:
            self.ctx.aengine.publish(self.consumer.failed.pop())
        now = time.monotonic()
        if self.ctx.metrics is not None and now - self._metrics_at >= 0.002:  # the hook may run every 100 us
            self._metrics_at = now
            self.ctx.metrics.update(core, extra_waiting=len(self.consumer.pending))

    async def _peer(self, tp: pb.TransferParams):  # type: ignore[no-untyped-def]
        """Handshake with P (cached per worker id + epoch). None when P is unreachable or restarted (stale epoch)
        or incompatible: the request is then computed locally (or failed, per policy)."""
        key = (tp.worker_id, tp.epoch)
        if key in self._peers:
            return self._peers[key]
        agent = self.ctx.agent
        if agent is None:
            return None
        async with self._peer_lock:
            if key in self._peers:
                return self._peers[key]
            try:
                async with grpc.aio.insecure_channel(tp.prefill_address) as ch:
                    md = await pb_grpc.PrefillServiceStub(ch).GetTransferMetadata(pb.TransferMetadataRequest(),
                                                                                  timeout=5.0)
                if md.epoch != tp.epoch:
                    log.warning("prefill worker %s restarted (epoch %s != %s): recomputing", tp.worker_id,
                                md.epoch, tp.epoch)
                    return None
                peer = await asyncio.to_thread(agent.add_peer, md.agent_metadata)
            except Exception as e:  # noqa: BLE001 - unreachable, incompatible, corrupted metadata
                log.warning("handshake with prefill worker %s failed: %s", tp.prefill_address, e)
                return None
            self._peers[key] = peer
            return peer

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        rid = request.request_id
        prompt = [int(t) for t in request.prompt_token_ids]
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        want_logprobs = request.sampling_params.logprobs
        salt = request.cache_salt or None
        tp = request.params if request.HasField("params") else None
        peer = await self._peer(tp) if tp is not None and tp.num_computed_tokens > 0 else None
        if tp is not None and tp.num_computed_tokens > 0 and peer is None and self.consumer.policy == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV transfer from the prefill worker is not possible")
        aengine = self.ctx.aengine
        q = aengine.open_stream(rid)
        sent_text = 0
        max_stop = max((len(s) for s in params.stop), default=0)

        def admit(core: EngineCore) -> str:
            req = core.new_request(rid, prompt, params, salt)
            if tp is None:
                core.scheduler.add_request(req)
                return "local"
            return self.consumer.admit(core, req, tp, peer)

        try:
            await run_engine_call(self.ctx, context, admit)
            while True:
                delta = await q.get()
                req = delta["request"]
                text = delta["text"] or ""
                finished = delta["finish_reason"] is not None
                end = len(text) if finished else max(sent_text, len(text) - max(0, max_stop - 1))
                while not finished and end > sent_text and text[end - 1] == "\ufffd":
                    end -= 1  # an incomplete UTF-8 sequence: wait for the next token
                chunk = pb.GenerateChunk(
                    token_ids=delta["token_ids"], text=text[sent_text:end],
                    logprobs=delta["logprobs"] if want_logprobs else [],
                    finish_reason=delta["finish_reason"] or "", num_prompt_tokens=len(prompt),
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    num_external_cached_tokens=req.external_computed_tokens,
                )
                sent_text = end
                if delta["finish_reason"] == "error":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(req.stop_reason or "request failed"))
                yield chunk
                if finished:
                    return
        except asyncio.CancelledError:
            aengine.call(lambda core: self._abort(core, rid))
            raise
        finally:
            aengine.close_stream(rid)

    def _abort(self, core: EngineCore, rid: str) -> bool:
        if self.consumer.abort(core, rid):
            return True
        existed = rid in core.scheduler.requests
        core.abort(rid)
        return existed

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        aborted = await self.ctx.aengine.acall(lambda core: self._abort(core, request.request_id))
        return pb.AbortResponse(aborted=bool(aborted))

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        return await self.ctx.aengine.acall(lambda core: stats_response(
            core, "decode", self.ctx.worker_id, self.ctx.epoch, self.ctx.metrics_port,
            extra_waiting=len(self.consumer.pending)))
