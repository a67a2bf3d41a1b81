"""PrefillService: compute a prompt, sample its first output token, pin its caches under a lease, and return the
token (streamed to the client at once by the proxy) with the transfer params a decode worker continues from. (The
same engine may also run whole requests: the mixed role, prefill/mixed.py.)

Threads: gRPC handlers run on the asyncio loop; everything touching the engine runs on the step thread
(`AsyncEngine.call` / hooks / on_finished callbacks)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

import grpc
from hybridpd.engine.core import EngineCore
from hybridpd.engine.request import Request
from hybridpd.engine.transfer import (
    Export,
    export_pages_needed,
    export_prefilled,
    pool_totals,
    release_export,
    schedule_local,
)
from hybridpd.kvtransfer.binding import new_lease_token, new_mac_key, params_mac, prompt_digest, verify_params_mac
from hybridpd.kvtransfer.errors import StaleEpochError
from hybridpd.kvtransfer.lease import CommitRefused, LeaseTable, Offer
from hybridpd.kvtransfer.metrics import TransferMetrics
from hybridpd.kvtransfer.progress import TransferProgress, interval_from_env
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc
from hybridpd.worker.context import WorkerContext, WorkerRpcs, precompile_structured, run_engine_call
from hybridpd.worker.convert import sampling_params_from_proto, set_prompt_logprobs, set_stop_match, stats_response
from hybridpd.worker.stream_text import first_text

log = logging.getLogger("hybridpd.prefill")


class PrefillServicer(WorkerRpcs, pb_grpc.PrefillServiceServicer):
    def __init__(self, ctx: WorkerContext, lease_seconds: float = 30.0, max_pinned_fraction: float = 0.5) -> None:
        if not 0 < max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in (0, 1], got {max_pinned_fraction}")
        self.ctx = ctx
        self.tmetrics = TransferMetrics("prefill")
        # wall clock: lease expiry travels to D and the proxy as unix time
        self.leases = LeaseTable(ctx.epoch, lease_seconds, clock=time.time, metrics=self.tmetrics)
        self._mac_key = new_mac_key()
        """Signs the transfer params this process issues (kvtransfer.binding.params_mac); never leaves it."""
        self.held: dict[str, tuple[Request, Export]] = {}
        """request id -> (prefilled request holding its caches, what it exports). Step thread only."""
        self.max_pinned_fraction = max_pinned_fraction
        self.max_generate = 0
        """Whole requests this worker takes at once (Stats): set by the mixed role (prefill/mixed.py), 0 without."""
        self.whole: Collection[str] = frozenset()
        """Ids of the whole requests running here (the mixed role's, event loop): a Prefill may not reuse one."""
        self._reserved: dict[str, dict[int, int]] = {}
        """request id -> {group id: pages} of prefills admitted but not yet leased (they will be pinned). Step
        thread only. Admission keeps pinned + reserved pages of each group within max_pinned_fraction of it."""
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._marks: dict[str, float] = {}
        """request id -> perf_counter() of its last handoff mark: Prefill received, then added, then leased
        (hybridpd_kv_handoff_seconds{role="prefill"}). Step thread once the request is added."""
        ctx.aengine.on_finished.append(self._on_finished)
        # Idle with no lease held: the step thread sleeps until called (no polling, ~0 CPU). While leases are held,
        # the hook reaps expired ones and, without NIXL's progress thread, progresses the agent every 0.5 ms so
        # that D's READs (UCX over TCP needs the target to progress) and release notices are served.
        ctx.aengine.add_hook(self._hook, needs_poll=lambda: len(self.leases) > 0)
        ctx.aengine.idle_wait = lambda: 5e-4 if len(self.leases) else None
        # ... and, while leases are held, a light thread progresses the agent between the engine's steps too: a busy
        # P otherwise served READs that need its progress (UCX over TCP) only once per step (kvtransfer/progress.py)
        self.progress: TransferProgress | None = None
        interval = interval_from_env(ctx.agent.layout.device_type) if ctx.agent is not None else None
        if ctx.agent is not None and not ctx.agent.config.progress_thread and interval is not None:
            self.progress = TransferProgress(ctx.agent.poll_releases, lambda: len(self.leases) > 0,
                                             interval_s=interval, on_notices=self._notices,
                                             name="nixl-progress-prefill")

    # -- step thread -----------------------------------------------------------------------------------------------
    def _free(self, request_id: str) -> None:
        """Unpin a prefilled request's caches (its lease was released or expired)."""
        req, exp = self.held.pop(request_id)
        release_export(self.ctx.core, req, exp)
        leased = self._marks.pop(request_id, None)
        if leased is not None:
            self.tmetrics.handoff("lease", time.perf_counter() - leased)

    def _release(self, request_id: str, epoch: str | None = None, token: str | None = None) -> bool:
        """Step thread. Idempotent; a release meant for another epoch of this worker, or presenting another
        lease's token, is ignored."""
        try:
            lease = self.leases.release(request_id, epoch, token)
        except StaleEpochError:
            return False
        if lease is not None:
            self._free(request_id)
        return lease is not None

    def _commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        """Any thread (the event loop: the answer does not wait for the engine step). D's READ completed: was the
        lease still held (pages pinned throughout) for this prompt, were the params D pulled by ours unaltered,
        and did D read only the pages they offer? Whoever ends a lease frees its pages on the step thread: here,
        by a call queued to it."""
        rid = request.request_id
        tp = request.params
        authentic = (request.HasField("params") and verify_params_mac(self._mac_key, rid, tp)
                     and tp.lease_token == request.lease_token and tp.epoch == request.epoch)
        read = {int(g.group_id): tuple(int(i) for i in g.block_ids) for g in request.pages_read}
        if len(read) != len(request.pages_read):
            read = {-1: ()}  # a group named twice: not what any offer allows
        try:
            lease = self.leases.commit(rid, request.epoch, request.lease_token, request.prompt_digest,
                                       params_authentic=authentic, pages_read=read)
        except CommitRefused as e:
            if e.reason not in ("stale_epoch", "unknown_lease", "token_mismatch"):  # the lease was ended
                self.ctx.aengine.call(lambda c: self._free(rid))
            self.tmetrics.transfer_failed(f"commit_{e.reason}")
            log.warning("commit of %s refused: %s", rid, e.reason)
            return pb.CommitResponse(committed=False, reason=e.reason)
        self.ctx.aengine.call(lambda c: self._free(lease.request_id))
        return pb.CommitResponse(committed=True)

    def _admit(self, core: EngineCore, request_id: str, num_tokens: int) -> str | None:
        """Step thread. Reserve the pages this prefill will pin; None if admitted, else why not. Attention blocks
        only: they are what grows with the prompt and what unpulled leases exhausted (12 abandoned prefills pinned
        1,500 of 1,569 blocks); a lease's state slots are bounded by max_num_seqs (one running slot per request,
        plus at most one checkpoint's pages)."""
        need = export_pages_needed(core, num_tokens)
        busy: dict[int, int] = {}
        for lease in (self.leases.get(rid) for rid in self.held):
            for gid, ids in (lease.pages_by_group.items() if lease is not None else ()):
                if gid in need:
                    busy[gid] = busy.get(gid, 0) + len(ids)
        for pages in self._reserved.values():
            for gid, n in pages.items():
                busy[gid] = busy.get(gid, 0) + n
        if any(busy.values()):  # one request alone is always admitted, however long: it could never run otherwise
            for gid, (kind, total) in pool_totals(core).items():
                if gid in need and busy.get(gid, 0) + need[gid] > self.max_pinned_fraction * total:
                    return (f"{busy.get(gid, 0)} of {total} {kind} pages are pinned or reserved for "
                            f"transfers (cap {self.max_pinned_fraction:.0%}); retry later or on another worker")
        self._reserved[request_id] = need
        return None

    def _notices(self, notices: list) -> None:
        """Progress thread: release notices it drained go to the step thread (unauthenticated: token checked)."""
        self.ctx.aengine.call(lambda c: [self._release(n.request_id, n.epoch, n.token) for n in notices])

    def _hook(self, core: EngineCore) -> None:
        expired = self.leases.reap()
        if expired:
            log.warning("lease expired for %d prefilled request(s): freed without a pull", len(expired))
        for lease in expired:
            self._free(lease.request_id)
        if self.ctx.agent is not None:
            for notice in self.ctx.agent.poll_releases():
                # unauthenticated NIXL traffic: only a notice with the lease's token ends it
                self._release(notice.request_id, notice.epoch, notice.token)
        if self.ctx.metrics is not None:
            self.ctx.metrics.update(core)

    def _on_finished(self, req: Request) -> None:
        if not req.prefill_only:  # a whole request of the mixed role (prefill/mixed.py): its stream has it
            return
        waiter = self._waiters.pop(req.request_id, None)
        self._reserved.pop(req.request_id, None)
        added = self._marks.pop(req.request_id, None)
        if req.finish_reason not in ("prefilled", "stop", "length") or not req.output_token_ids:
            if waiter is not None:
                loop, fut = waiter
                loop.call_soon_threadsafe(_set_exc, fut, RuntimeError(
                    f"prefill ended: {req.finish_reason}" + (f" ({req.stop_reason})" if req.stop_reason else "")))
            return
        now = time.perf_counter()
        if added is not None:
            self.tmetrics.handoff("prefill", now - added)
        first = first_chunk(self.ctx.core, req)
        if req.finish_reason != "prefilled":  # the first token ended the request: nothing to hand off
            if waiter is not None:
                loop, fut = waiter
                loop.call_soon_threadsafe(_set_result, fut, pb.PrefillResponse(
                    request_id=req.request_id, num_cached_tokens=max(req.num_cached_tokens, 0), first=first))
            return
        exp = export_prefilled(self.ctx.core, req)
        n = exp.num_tokens
        digest = prompt_digest(req.prompt_token_ids, n, req.cache_salt)
        self.held[req.request_id] = (req, exp)
        lease = self.leases.grant(req.request_id, exp.pinned, token=new_lease_token(), prompt_digest=digest,
                                  offer=offer_of(exp))
        if self.progress is not None:
            self.progress.wake()
        self._marks[req.request_id] = now
        if waiter is None:  # the caller went away: nobody will pull
            self._release(req.request_id)
            return
        params = transfer_params(exp)
        params.MergeFrom(pb.TransferParams(
            worker_id=self.ctx.worker_id, epoch=self.ctx.epoch, prefill_address=self.ctx.address,
            num_prompt_tokens=req.num_prompt_tokens, lease_expiry_unix=lease.expires_at,
            lease_token=lease.token, prompt_digest=digest,
        ))
        params.mac = params_mac(self._mac_key, req.request_id, params)
        resp = pb.PrefillResponse(request_id=req.request_id, params=params,
                                  num_cached_tokens=max(req.num_cached_tokens, 0), first=first)
        loop, fut = waiter
        loop.call_soon_threadsafe(_set_result, fut, resp)

    def has_request(self, request_id: str) -> bool:
        """A prefill of this id is running or holds a lease here (event loop)."""
        return request_id in self.held or request_id in self._waiters

    # -- RPCs --------------------------------------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        t_received = time.perf_counter()
        rid = request.request_id
        prompt = [int(t) for t in request.prompt_token_ids]
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await precompile_structured(self.ctx, context, params)
        if rid in self.held or rid in self._waiters or rid in self.whole:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already prefilled or running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiters[rid] = (loop, fut)
        salt = request.cache_salt or None

        def add(core: EngineCore) -> str | None:
            """One step-thread round trip: validate (new_request), reserve the pages to pin, schedule."""
            req = core.new_request(rid, prompt, params, salt, prefill_only=True)
            refusal = self._admit(core, rid, len(prompt))
            if refusal is None:
                try:
                    schedule_local(core, req)
                except BaseException:
                    self._reserved.pop(rid, None)
                    raise
                now = time.perf_counter()
                self.tmetrics.handoff("queue", now - t_received)
                self._marks[rid] = now
            return refusal

        try:
            try:
                refusal = await run_engine_call(self.ctx, context, add)
            except BaseException:
                self._waiters.pop(rid, None)  # invalid prompt (INVALID_ARGUMENT): nothing was added
                raise
            if refusal is not None:
                self._waiters.pop(rid, None)
                self.tmetrics.admission_refused()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            resp = await fut
            self._release_if_undelivered(context, rid, resp)
            return resp
        except asyncio.CancelledError:
            self._waiters.pop(rid, None)
            self.ctx.aengine.call(lambda c: (c.abort(rid), self._reserved.pop(rid, None), self._release(rid)))
            raise
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
            raise

    def _release_if_undelivered(self, context: grpc.aio.ServicerContext, rid: str, resp: pb.PrefillResponse) -> None:
        """End the lease of `resp` if its RPC ends cancelled: its caller gave up as the answer left (the proxy's
        client went away mid-prefill), so nobody holds the lease token, and the caller's Release (by id alone)
        cannot end it; it would pin the prompt's pages until it expired."""
        token = resp.params.lease_token
        if not token:
            return

        def ended(ctx: grpc.aio.ServicerContext) -> None:
            if ctx.cancelled():
                self.ctx.aengine.call(lambda c: self._release(rid, None, token))

        context.add_done_callback(ended)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        released = await self.ctx.aengine.acall(
            lambda c: self._release(request.request_id, request.epoch or None, request.lease_token))
        return pb.ReleaseResponse(released=bool(released))

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        return self._commit(request)

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        def stats(core: EngineCore) -> pb.StatsResponse:
            pinned: dict[int, int] = {}
            for rid in self.held:
                lease = self.leases.get(rid)
                for gid, ids in (lease.pages_by_group.items() if lease is not None else ()):
                    pinned[gid] = pinned.get(gid, 0) + len(ids)
            return stats_response(core, "prefill", self.ctx.worker_id, self.ctx.epoch, self.ctx.metrics_port,
                                  pinned, len(self.leases), max_generate=self.max_generate)
        return await self.ctx.aengine.acall(stats)


def transfer_params(exp: Export) -> pb.TransferParams:
    """The export's pages as TransferParams: every attention group's blocks, every recurrent group's slots."""
    ckpt = exp.checkpoint
    states = [pb.GroupStates(group_id=gid, state_slot=slot) for gid, slot in exp.state_slots.items()]
    return pb.TransferParams(
        groups=[pb.GroupBlocks(group_id=gid, block_ids=ids) for gid, ids in exp.blocks.items()], states=states,
        checkpoint_num_tokens=ckpt.num_tokens if ckpt else 0, num_computed_tokens=exp.num_tokens,
        checkpoint_pages=ckpt.pages if ckpt else (),
    )


def first_chunk(core: EngineCore, req: Request) -> pb.GenerateChunk:
    """The first output token of a request P sampled, as the chunk D would have streamed it (step thread): its
    logprob (and alternatives when asked), its text held back by the decode stream's rule, and the end when it
    ended the request."""
    ended = req.finish_reason != "prefilled"
    chunk = pb.GenerateChunk(
        token_ids=req.output_token_ids, text=first_text(core, req), logprobs=req.output_logprobs,
        top_logprobs=[pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
                      for top in req.output_top_logprobs],
        finish_reason=req.finish_reason if ended else "", num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0))
    set_stop_match(chunk, core.stop_match(req))
    if req.prompt_logprobs is not None:
        set_prompt_logprobs(chunk, req.prompt_logprobs)
    return chunk


def offer_of(exp: Export) -> Offer:
    """The pages `transfer_params(exp)` names, as the lease checks them at Commit."""
    pages = exp.checkpoint.pages if exp.checkpoint is not None else ()
    states = {gid: (slot,) for gid, slot in exp.state_slots.items()}
    return Offer({gid: tuple(ids) for gid, ids in exp.blocks.items()}, states, tuple(pages))


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
