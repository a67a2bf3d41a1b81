"""DecodeService: Generate (server stream), Abort, GetTransferMetadata, Health, Stats.

Threads: handlers run on the asyncio loop; engine work runs on the step thread via `AsyncEngine.call` and the
step hook (pull polling, metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict

import grpc
from hybridpd.decode.consumer import Consumer, PendingPull, overlap_from_env
from hybridpd.engine.async_engine import HOT_POLL_S, OutputDelta, take_pending
from hybridpd.engine.core import EngineCore
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.transfer import add_first_token, first_token_problem, schedule_local
from hybridpd.kvtransfer.binding import new_nonce, verify_membership
from hybridpd.kvtransfer.progress import TransferProgress, interval_from_env
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc
from hybridpd.worker.auth import open_channel, token_metadata
from hybridpd.worker.context import WorkerContext, WorkerRpcs, precompile_structured, run_engine_call
from hybridpd.worker.convert import chunk_of, sampling_params_from_proto, stats_response
from hybridpd.worker.stream_text import streamable_end

log = logging.getLogger("hybridpd.decode")

MAX_PREFILL_PEERS = 64
"""Prefill workers a decode worker keeps handshaken at once. A worker id lives as long as its process, so every
prefill restart is a new peer: past this many the least recently used is forgotten (a later request from it
handshakes again)."""


class DecodeServicer(WorkerRpcs, pb_grpc.DecodeServiceServicer):
    """Which prefill workers D pulls from: with a cluster token, those that prove they hold it (HMAC over D's nonce
    in the handshake); with `prefill_peers`, only those addresses; with neither (an open development cluster), any.
    A peer is bound to the address it was verified at: Commit goes there, never to an address a caller names."""

    def __init__(
        self,
        ctx: WorkerContext,
        policy: str = "recompute",
        pull_timeout_s: float = 10.0,
        prefill_peers: tuple[str, ...] = (),
        commit_timeout_s: float = 5.0,
    ) -> None:
        self.ctx = ctx
        metrics = ctx.agent.metrics if ctx.agent is not None else None
        self.consumer = Consumer(
            policy, pull_timeout_s, commit=self._start_commit, metrics=metrics, overlap=overlap_from_env()
        )
        ctx.core.transfer_canceller = self.consumer.cancel  # the engine ends imports through its finish path
        self.prefill_peers = frozenset(prefill_peers)
        self.commit_timeout_s = commit_timeout_s
        self._peers: OrderedDict[tuple[str, str], tuple[object, str]] = OrderedDict()
        """(P worker id, epoch) -> (NIXL peer handle, the gRPC address it was verified at); least recently used
        first, at most MAX_PREFILL_PEERS. Event loop only."""
        self._retired: list[tuple[tuple[str, str], object]] = []
        """Peers forgotten by `_peers` that the agent still holds: removed from it once no pull of theirs is in
        flight. Step thread only."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peer_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.streaming: set[str] = set()
        """Ids of the Generate calls streaming from here (event loop only): a call reusing one is refused before it
        can take over that request's output stream."""
        # while a pull is in flight and nothing else runs, poll it every 100 us: an idle decode worker then sees the
        # KV land within 0.1 ms (docs/BENCHMARKS.md, KV transfer); while only Commits are in flight (requests parked
        # or waiting for P's answer) it wakes at the earliest import deadline to enforce it; else it sleeps until called
        ctx.aengine.add_hook(self._hook, needs_poll=lambda: self._idle_wait() is not None)
        ctx.aengine.idle_wait = self._idle_wait
        # while the engine steps, the hook polls once per step: a light thread progresses the agent in between while
        # pulls are in flight (a READ over UCX/TCP advances only while D progresses too; kvtransfer/progress.py)
        self.progress: TransferProgress | None = None
        interval = interval_from_env(ctx.agent.layout.device_type) if ctx.agent is not None else None
        if ctx.agent is not None and not ctx.agent.config.progress_thread and interval is not None:
            self.progress = TransferProgress(
                ctx.agent.poll_releases,
                lambda: len(self.consumer.pending) > 0,
                interval_s=interval,
                name="nixl-progress-decode",
            )

    def _idle_wait(self) -> float | None:
        """Step thread: how long the idle engine may sleep before the hook runs again (None: until called)."""
        if self.consumer.num_pulling():
            return 1e-4
        core = self.ctx.core
        deadline = core.next_import_deadline()
        return None if deadline is None else max(deadline - core.clock(), HOT_POLL_S)

    def _hook(self, core: EngineCore) -> None:
        self.consumer.poll(core)
        if self._retired:
            self._drop_retired(core, [])
        core.expire_imports()  # also between steps: an import past its deadline is let go
        if self.ctx.metrics is not None:  # at most every 2 ms (WorkerMetrics.min_interval_s)
            self.ctx.metrics.update(core, extra_waiting=core.num_importing)

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, self.ctx.tls)
        return ch

    def _prefill_stub(self, address: str) -> pb_grpc.PrefillServiceStub:
        return pb_grpc.PrefillServiceStub(self._channel(address))

    def _unknown_peer(self, tp: pb.TransferParams, why: str) -> None:
        log.warning("not pulling from %s (worker %s): %s", tp.prefill_address, tp.worker_id, why)
        if self.consumer.metrics is not None:
            self.consumer.metrics.transfer_failed("unknown_peer")

    async def _peer(self, tp: pb.TransferParams):  # type: ignore[no-untyped-def]
        """Handshake with P (cached per worker id + epoch). None when P is unknown (not listed, or cannot prove
        it holds the cluster token), unreachable, restarted (stale epoch) or incompatible: the request is then
        computed locally (or failed, per policy)."""
        key = (tp.worker_id, tp.epoch)
        known = self._peers.get(key)
        if known is not None and not getattr(known[0], "valid", True):
            # the agent replaced it: another epoch answered under this worker id (a restart keeps no id, so only a
            # holder of the cluster token claiming it): handshake again rather than refuse this worker for good
            del self._peers[key]
            known = None
        if known is not None:
            if known[1] != tp.prefill_address:
                self._unknown_peer(tp, f"worker {tp.worker_id} was verified at {known[1]}")
                return None
            self._peers.move_to_end(key)
            return known[0]
        agent = self.ctx.agent
        if agent is None:
            return None
        if self.prefill_peers and tp.prefill_address not in self.prefill_peers:
            self._unknown_peer(tp, "address not among --prefill-peer")
            return None
        async with self._peer_lock:
            if key in self._peers:
                return await self._peer(tp)
            token = self.ctx.cluster_token
            nonce = new_nonce()
            try:
                md = await self._prefill_stub(tp.prefill_address).GetTransferMetadata(
                    pb.TransferMetadataRequest(nonce=nonce), timeout=5.0, metadata=token_metadata(token)
                )
                if md.epoch != tp.epoch or md.worker_id != tp.worker_id:
                    log.warning(
                        "prefill worker at %s is %s/%s, params name %s/%s (restarted?): recomputing",
                        tp.prefill_address,
                        md.worker_id,
                        md.epoch,
                        tp.worker_id,
                        tp.epoch,
                    )
                    return None
                if token and not verify_membership(
                    token, nonce, md.worker_id, md.epoch, md.agent_metadata + md.tp_layout, md.proof
                ):
                    self._unknown_peer(tp, "it cannot prove it holds the cluster token")
                    return None
                peer = await asyncio.to_thread(self._connect, md)
            except Exception as e:  # noqa: BLE001 - unreachable, incompatible, corrupted metadata
                log.warning("handshake with prefill worker %s failed: %s", tp.prefill_address, e)
                return None
            self._remember(key, peer, tp.prefill_address)
            return peer

    def _remember(self, key: tuple[str, str], peer: object, address: str) -> None:
        """Keep a verified peer. An earlier worker verified at the same address is gone (an address serves one
        process: that one stopped or restarted), and past MAX_PREFILL_PEERS the least recently used is dropped;
        both are retired (`_drop_retired`)."""
        gone = [k for k, (_, a) in self._peers.items() if a == address and k != key]
        self._peers[key] = (peer, address)
        self._peers.move_to_end(key)
        over = max(0, len(self._peers) - len(gone) - MAX_PREFILL_PEERS)
        excess = [k for k in self._peers if k != key and k not in gone][:over]
        retired = [(k, self._peers.pop(k)[0]) for k in (*gone, *excess)]
        if retired:
            log.info("forgetting prefill peer(s) %s", ", ".join(w for (w, _), _ in retired))
            self.ctx.aengine.call(lambda core: self._drop_retired(core, retired))

    def _drop_retired(self, core: EngineCore, retired: list[tuple[tuple[str, str], object]]) -> None:
        """Step thread: remove retired peers from the transfer agent, each once no pull from it is in flight (the
        others wait for a later call); a tensor-parallel peer on every rank (`forget_rank_peer`)."""
        from hybridpd.engine.parallel.handoff import on_ranks
        from hybridpd.kvtransfer.tp_pull import TPPeer, forget_rank_peer

        self._retired.extend(retired)
        busy = {(p.params.worker_id, p.params.epoch) for p in self.consumer.pending.values()}
        agent, waiting = self.ctx.agent, []
        for key, peer in self._retired:
            if key in busy:
                waiting.append((key, peer))
            elif isinstance(peer, TPPeer):
                on_ranks(core, forget_rank_peer, peer.key)
            elif agent is not None:
                agent.remove_peer(peer)
        self._retired = waiting

    def _connect(self, md: pb.TransferMetadata):  # type: ignore[no-untyped-def]
        """The peer handle for P's handshake: NIXL's own (both TP 1) or a TPPeer whose ranks' layouts were checked
        against ours (kvtransfer/tp_pull.py). Raises CompatibilityError naming the differences."""
        from hybridpd.kvtransfer.errors import CompatibilityError
        from hybridpd.kvtransfer.tp_handshake import TPLayout, problems
        from hybridpd.kvtransfer.tp_pull import TPPeer
        from hybridpd.kvtransfer.tp_slices import same_slicing

        mine = self.ctx.tp_layout
        peer_tp = TPLayout.decode(md.tp_layout) if md.tp_layout else None
        if mine is None or ((peer_tp is None or peer_tp.tp_size == 1) and mine.tp_size == 1):
            return self.ctx.agent.add_peer(md.agent_metadata)
        if peer_tp is None:
            raise CompatibilityError(
                f"prefill worker {md.worker_id} publishes no tensor-parallel layout and this "
                f"decode worker runs {mine.tp_size} ranks"
            )
        bad = problems(mine, peer_tp)
        if bad:
            raise CompatibilityError(
                f"prefill worker {md.worker_id} (tp {peer_tp.tp_size}) cannot hand off to this "
                f"decode worker (tp {mine.tp_size}): " + "; ".join(bad)
            )
        return TPPeer(md.worker_id, md.epoch, md.tp_layout, whole_pages=same_slicing(mine.flat(), peer_tp.flat()))

    # -- commit: step thread -> event loop -> step thread -----------------------------------------------------------
    def _start_commit(self, p: PendingPull) -> None:
        """Step thread: a pull's READ is DONE; ask P (on the event loop) whether its lease was still held."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._commit(p), self._loop)

    async def _commit(self, p: PendingPull) -> None:
        rid, tp, digest, read = p.req.request_id, p.params, p.digest, p.pages_read
        req = pb.CommitRequest(
            request_id=rid,
            epoch=tp.epoch,
            lease_token=tp.lease_token,
            prompt_digest=digest,
            params=tp,
            pages_read=[pb.GroupBlocks(group_id=g, block_ids=ids) for g, ids in read.items()],
        )
        address = self._peers.get((tp.worker_id, tp.epoch), (None, tp.prefill_address))[1]
        t0 = time.perf_counter()
        try:
            resp = await self._prefill_stub(address).Commit(
                req, timeout=self.commit_timeout_s, metadata=token_metadata(self.ctx.cluster_token)
            )
            committed, reason = resp.committed, resp.reason
        except grpc.aio.AioRpcError as e:  # P unreachable or frozen: its lease cannot be confirmed
            committed, reason = False, f"commit failed: {e.code().name}"
        except Exception as e:  # noqa: BLE001
            committed, reason = False, f"commit failed: {e}"
        if self.consumer.metrics is not None:
            self.consumer.metrics.commit_seconds(time.perf_counter() - t0)
        self.ctx.aengine.call(lambda core: self._answer(core, p, committed, reason))

    def _answer(self, core: EngineCore, p: PendingPull, committed: bool, reason: str) -> None:
        """Step thread: P's answer to the pull `p`. A confirmed request's held-back output goes to its stream now,
        not after the next step."""
        req = self.consumer.on_commit(core, p, committed, reason)
        if req is not None and not req.is_finished:
            self.ctx.aengine.publish(req)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        t_received = time.perf_counter()
        rid = request.request_id
        prompt = [int(t) for t in request.prompt_token_ids]
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        want_logprobs = request.sampling_params.logprobs
        salt = request.cache_salt or None
        tp = request.params if request.HasField("params") else None
        first = request.first_token if request.HasField("first_token") else None
        if first is not None and params.prompt_logprobs is not None:  # the prefill worker scored the prompt
            params = dataclasses.replace(params, prompt_logprobs=None)
        if tp is not None and first is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "transfer params come with the first token the prefill worker sampled (GenerateRequest.first_token)",
            )
        resume = request.resume if request.HasField("resume") else None
        resumed = [int(t) for t in resume.token_ids] if resume is not None else []
        if resume is not None and (first is None or tp is not None):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a resumed request (GenerateRequest.resume) comes with its first output token and no transfer params",
            )
        await precompile_structured(self.ctx, context, params)
        self._loop = asyncio.get_running_loop()
        peer = await self._peer(tp) if tp is not None and tp.num_computed_tokens > 0 else None
        t_peer = time.perf_counter()
        timed = tp is not None and peer is not None
        if tp is not None and tp.num_computed_tokens > 0 and peer is None and self.consumer.policy == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV transfer from the prefill worker is not possible")
        if rid in self.streaming:  # (checked and taken with no await between)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running here")
        self.streaming.add(rid)
        aengine = self.ctx.aengine
        # the proxy streamed the first token (and, resuming, the output after it)
        q = aengine.open_stream(rid, emitted=1 + len(resumed) if first is not None else 0)
        max_stop = max((len(s) for s in params.stop), default=0)

        def admit(core: EngineCore) -> int:
            """Add the request (continuing from the first token, and a resume's tokens, when given); returns the
            characters of its text already streamed with them."""
            req = core.new_request(rid, prompt, params, salt)
            if first is not None:
                problem = first_token_problem(core, req, int(first.token_id), resumed)
                if problem is not None:
                    raise InvalidRequestError(problem)
            if tp is None:
                schedule_local(core, req)
            elif self.consumer.admit(core, req, tp, peer) == "pulling" and self.progress is not None:
                self.progress.wake()
            if first is None:
                return 0
            top = zip(first.top_logprobs.token_ids, first.top_logprobs.logprobs, strict=False)
            add_first_token(core, req, int(first.token_id), float(first.logprob), list(top), resumed)
            if resume is None:
                return streamable_end(core.output_text(req), 0, False, max_stop)
            text = core.output_text(req)
            if not 0 <= resume.text_chars <= len(text):
                core.abort(rid)
                raise InvalidRequestError(
                    f"resume.text_chars {resume.text_chars} is outside the resumed output's text (0..{len(text)})"
                )
            return int(resume.text_chars)

        try:
            sent_text = await run_engine_call(self.ctx, context, admit)
            while True:
                delta: OutputDelta = take_pending(q, await q.get())
                text = delta.text
                finished = delta.finish_reason is not None
                end = streamable_end(text, sent_text, finished, max_stop)
                chunk = chunk_of(delta, text[sent_text:end], want_logprobs)
                if resume is not None:
                    chunk.num_resumed_tokens = 1 + len(resumed)
                sent_text = end
                if timed and (delta.token_ids or finished):
                    timed = False
                    self._time_handoff(rid, t_received, t_peer)
                if delta.finish_reason == "error":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, delta.stop_reason or "request failed")
                yield chunk
                if finished:
                    return
        except asyncio.CancelledError:
            aengine.call(lambda core: self._abort(core, rid))
            raise
        finally:
            aengine.close_stream(rid)
            self.consumer.handed_over.pop(rid, None)
            self.streaming.discard(rid)

    def _time_handoff(self, rid: str, t_received: float, t_peer: float) -> None:
        """hybridpd_kv_handoff_seconds{role="decode"} of a request whose pull was committed (others: nothing)."""
        marks = self.consumer.handed_over.pop(rid, None)
        m = self.consumer.metrics
        if marks is None or m is None:
            return
        posted, done, committed = marks
        now = time.perf_counter()
        for phase, seconds in (
            ("handshake", t_peer - t_received),
            ("admit", posted - t_peer),
            ("pull", done - posted),
            ("commit", committed - done),
            ("resume", now - committed),
            ("total", now - t_received),
        ):
            m.handoff(phase, seconds)
        log.debug(
            "handoff %s: handshake %.1f admit %.1f pull %.1f commit %.1f resume %.1f total %.1f ms",
            rid,
            1e3 * (t_peer - t_received),
            1e3 * (posted - t_peer),
            1e3 * (done - posted),
            1e3 * (committed - done),
            1e3 * (now - committed),
            1e3 * (now - t_received),
        )

    def _abort(self, core: EngineCore, rid: str) -> bool:
        """Step thread. Ends the request (pulling, committing, waiting or running) and its stream: the Generate
        call sees a last chunk with finish_reason "abort" (an open stream must never be left waiting)."""
        return core.abort(rid) is not None  # pulling or committing too: the engine cancels the pull (Consumer.cancel)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        aborted = await self.ctx.aengine.acall(lambda core: self._abort(core, request.request_id))
        return pb.AbortResponse(aborted=bool(aborted))

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        return await self.ctx.aengine.acall(
            lambda core: stats_response(
                core,
                "decode",
                self.ctx.worker_id,
                self.ctx.epoch,
                self.ctx.metrics_port,
                extra_waiting=core.num_importing,
            )
        )
