"""One request's trip through the cluster: pick workers, P.Prefill (unless colocated), then the D.Generate stream.

    proxy                      prefill worker P               decode worker D
      | Prefill(ids, sampling) ---> |  computes the N prompt tokens, samples token 1, pins blocks under a lease
      | <--- token 1, TransferParams|
      |  (token 1 goes to the client at once; if it ends the request, D is never called and nothing is leased)
      | Generate(ids, sampling, params, token 1) -----------------> |  pulls from P, releases P's lease,
      | <--- GenerateChunk ... GenerateChunk(finish_reason) ------- |  decodes from token 1: tokens 2, 3, ...

Time to first token is P's answer (its `first` chunk); D's first chunk carries token 2.

Skip-P and P-alone (proxy/placement.py): Generate without params goes straight to a decode worker, or (P-alone) to
a prefill worker in its mixed role (DecodeService on the same address), which computes the prompt and every token
itself; no lease is involved. A P-alone request is counted on the prefill router (its prompt tokens in P's queue
until its first chunk). A prefill worker that refuses it before any chunk (down, at its cap, no mixed role) is
replaced by a decode worker; one lost mid-stream is resumed on a decode worker, as a decode worker is (below).

Failover. Before a decode worker's first chunk, a worker that is unreachable (or frozen, by the health monitor) is
replaced by another (`_retry_decode`). After it, a worker lost (UNAVAILABLE) or silent for `inter_token_timeout_s`
is replaced with a resume (`_resume_elsewhere`): the next decode worker is sent what the client already has
(`GenerateRequest.resume`: the output tokens and the length of their text), recomputes it with the prompt and
streams only what follows: the client's stream, streamed or not, never repeats or skips a token, and greedy or
seeded requests end with the very tokens one worker would have produced. At most `MAX_RESTARTS` times; counted in
`hybridpd_proxy_decode_failovers_total{cause, outcome}`.

Ownership of P's lease (see the contract on `DecodeService` in hybridpd.proto):
  - Generate never sent (client gone, or no decode worker)    -> the proxy calls P.Release;
  - Generate ended with an error status before any chunk      -> D holds no reads of P's blocks: P.Release;
  - the client went away before D's first chunk (it had P's first token) -> D.Abort and P.Release (D may not have
    the request yet; a READ it did start is refused at Commit, so P's pages are never used);
  - D's first chunk shows no pulled tokens (D computed the prompt itself)     -> P.Release;
  - otherwise D owns it; a client disconnect only sends D.Abort (D stops its pulls and releases P).
Cleanup RPCs run in the background (`WorkerClients.abort_later/release_later`): `close()` never awaits.

Deadlines: the request has `config.request_timeout_s` from arrival; Prefill gets what is left (capped by
`prefill_timeout_s`), Generate the rest. Expiry is a 504 (`errors.timeout_error`). A prefill worker that answers
RESOURCE_EXHAUSTED (too many pinned leases) or UNAVAILABLE (down) is skipped and the next one tried; when all are at
capacity, the request is shed with 503 and `Retry-After` (all down: 503 worker_unavailable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proxy.config import ProxyConfig
from hybridpd.proxy.deltas import (
    Delta,
    PreparedRequest,
    Usage,
    first_token_of,
    prompt_logprobs_of,
    stop_reason_of,
    to_proto_sampling,
    top_logprobs_of,
)
from hybridpd.proxy.errors import ApiError, from_rpc_error, timeout_error
from hybridpd.proxy.metrics import ProxyMetrics
from hybridpd.proxy.routing import NoWorkerError, Router
from hybridpd.proxy.workers import WorkerClients

if TYPE_CHECKING:
    from hybridpd.proxy.membership import Membership
    from hybridpd.proxy.placement import Placement, Placer

log = logging.getLogger(__name__)

# Prefill answers after which another prefill worker is tried: at its lease cap, or down (the request holds nothing
# on a worker that is unreachable or died, and a new worker gets a fresh request under the same id).
_RETRY_ON_ANOTHER_PREFILL = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
# Generate answers of a prefill worker sent a whole request (P-alone) after which a decode worker gets it instead:
# down, at its mixed-role cap, or a worker without the mixed role.
_WHOLE_ELSEWHERE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}
)


FROZEN_CHECK_S = 0.25
"""How often a Prefill in flight checks whether its worker stopped answering health probes."""


class _WorkerFrozen(Exception):
    """A worker stopped answering health probes while another of its role answers: the call to it was given up."""


class _WorkerStalled(Exception):
    """A decode worker sent nothing mid-stream for `ProxyConfig.inter_token_timeout_s`, or stopped answering health
    probes while another decode worker answers: the stream was given up (the message says which)."""


async def _prefill_unless_frozen(
    clients: WorkerClients, router: Router, addr: str, req: pb.PrefillRequest, timeout: float
) -> pb.PrefillResponse:
    """P.Prefill on `addr`; given up (cancelled, _WorkerFrozen) once the health monitor finds `addr` unresponsive
    while another prefill worker answers. A frozen worker keeps its connection open, so the call alone would wait
    for as long as it stays frozen; cancelled, the worker frees what it prefilled when it resumes. An answer that
    arrives for a caller that gave up (cancelled, its client gone, as the answer came) is released with its lease
    token, which only this answer carries: a Release by request id alone cannot end the lease."""
    call = asyncio.ensure_future(clients.prefill_call(addr, req, timeout))
    answered = False
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=None if len(router.members) < 2 else FROZEN_CHECK_S)
            if done:
                answered = True
                return call.result()
            if router.is_unresponsive(addr) and any(a != addr for a in router.addrs):
                raise _WorkerFrozen(addr)
    finally:
        if not answered:
            call.add_done_callback(lambda c: _release_unclaimed(clients, addr, req.request_id, c))
            call.cancel()  # (no-op when the answer already came: then the callback releases its lease)


def _release_unclaimed(clients: WorkerClients, addr: str, rid: str, call: asyncio.Future[pb.PrefillResponse]) -> None:
    """A Prefill answer nobody waits for any more: end its lease on P."""
    if call.cancelled() or call.exception() is not None:
        return  # P saw the call cancelled or failed: it holds nothing for it
    params = call.result().params
    if params.lease_token:
        clients.release_later(addr, rid, params.epoch, params.lease_token)


@dataclass(frozen=True)
class Cluster:
    """What every request shares: config, gRPC clients, one router per role, metrics. Owned by the app."""

    config: ProxyConfig
    clients: WorkerClients
    prefill: Router | None  # None when colocated
    decode: Router
    metrics: ProxyMetrics
    membership: Membership | None = None
    """Live members, their cache indexes and up/down state (proxy/membership.py); None in bare test clusters."""
    placer: Placer | None = None
    """Cache- and cost-aware placement (routing policy cache_aware); None: the routers' own policy."""


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None
    first_token: float | None = None


@dataclass
class _Sent:
    """The output the client has (or, not streamed, will have) of this request: what a resumed Generate carries."""

    token_ids: list[int] = field(default_factory=list)
    first_logprob: float = 0.0
    text_chars: int = 0


@dataclass
class _State:
    prefill_addr: str | None = None
    prefill_epoch: str = ""
    lease_token: str = ""  # P's lease token: Release must present it
    prefilled: bool = False  # P holds a lease for this request (its Release is ours until D takes it)
    first_token: pb.FirstToken | None = None  # sampled by P: every Generate of this request continues from it
    decode_routed: bool = False  # D's first chunk seen (routing metrics and step costs recorded)
    decode_addr: str | None = None
    call: grpc.aio.UnaryStreamCall | None = None
    got_chunk: bool = False
    placement: Placement | None = None
    generate_sent: float = 0.0
    decode_tried: tuple[str, ...] = ()  # decode workers that were unreachable for this request
    finished: bool = False
    status: str | None = None  # metrics status, set once
    prefill_released: bool = False  # P.Release sent (at most once)
    decode_slot_released: bool = False  # the decode router's in-flight count given back (exactly once)
    paced: bool = False  # the current Generate sent its first tokens: later gaps measure its pace (placer)
    on_prefill: bool = False  # P-alone: Generate went to a prefill worker (counted on the prefill router)
    queued_tokens: int = 0  # P-alone: prompt tokens counted in that worker's queue until its first chunk


class Generation:
    """Drives one request. Lifecycle:

    first = await gen.start()      # route + prefill + first output; raises ApiError before anything is sent
    async for delta in gen.rest(): # later output; raises ApiError on a mid-stream worker failure
    gen.close()                    # always (finally): aborts / releases if unfinished, records metrics
    """

    def __init__(self, cluster: Cluster, req: PreparedRequest, arrival: float) -> None:
        self.cluster = cluster
        self.req = req
        self.usage = Usage(prompt_tokens=len(req.prompt_token_ids), counts_prompt=req.counts_prompt)
        self._t = _Timing(arrival=arrival)
        self._s = _State()
        self._deadline = arrival + cluster.config.request_timeout_s
        self._sent = _Sent()
        self.restarts = 0
        """Decode workers this request was resumed away from (lost or stalled mid-generation)."""

    def _remaining(self, what: str) -> float:
        left = self._deadline - time.perf_counter()
        if left <= 0:
            raise self._fail(timeout_error(what))
        return left

    @property
    def finished(self) -> bool:
        return self._s.finished

    async def start(self) -> Delta:
        """The first output: P's first token under PD (D is then sent the request, unless that token ended it),
        else D's first chunk."""
        placement = self._place()
        skip = placement is not None and placement.prefill_addr is None
        if self.cluster.prefill is None or skip:
            self._open_generate(None)
            return await self._next_delta()
        resp = await self._prefill(self.cluster.prefill)
        if resp is None:  # no prefill worker up: the decode worker computes the prompt itself (skip-P)
            self._open_generate(None)
            return await self._next_delta()
        first = self._absorb(resp.first, from_decode=False)
        if first.finish_reason is None:
            self._s.first_token = first_token_of(resp.first)
            self._open_generate(self._params(resp))
        return first

    def _place(self) -> Placement | None:
        placer = self.cluster.placer
        if placer is None:
            return None
        try:
            p = placer.place(self.req.prompt_token_ids, self.req.cache_salt, self._s.decode_tried)
        except NoWorkerError:
            return None  # the routers raise it again with the proper error
        self._s.placement = p
        return p

    async def rest(self) -> AsyncIterator[Delta]:
        while not self._s.finished:
            yield await self._next_delta()

    async def collect_after(self, first: Delta) -> list[Delta]:
        """Every delta of a non-streamed request, after its first (`start()`)."""
        deltas = [first]
        while not self._s.finished:
            deltas.append(await self._next_delta())
        return deltas

    MAX_RESTARTS = 2
    """Decode workers one request may lose (or see stall) mid-generation before it fails."""

    def _resume_elsewhere(self, cause: str) -> bool:
        """The decode worker was lost (`cause` "lost": UNAVAILABLE) or made no progress ("stalled") after its first
        chunk: resume the request on another decode worker (`_open_generate`'s resume: it computes the prompt and
        the output already sent, and streams only what follows, so the client's stream neither repeats nor skips a
        token; greedy and seeded requests go on with the very tokens the lost worker would have sent, others with
        a fresh sample that continues the same text). False, counted as failed: too many restarts, or no decode
        worker left."""
        s = self._s
        if self.restarts >= self.MAX_RESTARTS or not self._another_decode_left():
            self.cluster.metrics.decode_failover(cause, "failed")
            return False
        log.warning(
            "decode worker %s %s mid-generation of %s after %d output tokens: resuming it elsewhere",
            s.decode_addr,
            "lost" if cause == "lost" else "stalled",
            self.req.request_id,
            len(self._sent.token_ids),
        )
        self.restarts += 1
        s.got_chunk = False
        s.prefill_released = True  # the lost worker owned P's lease since its first chunk (released or expiring)
        self._send_elsewhere()
        self.cluster.metrics.decode_failover(cause, "resumed")
        return True

    def _another_decode_left(self) -> bool:
        """Counts the current decode worker as tried; whether a routable one is left untried."""
        s = self._s
        assert s.decode_addr is not None  # (its cache-event feed breaks too when it died: membership marks it down)
        s.decode_tried = (*s.decode_tried, s.decode_addr)
        return any(a not in s.decode_tried for a in self.cluster.decode.addrs)

    def _send_elsewhere(self) -> None:
        """Cancel the Generate in flight and give its slot back; send the request, without P's params (D computes
        the prompt, and continues from P's first token when there is one, or resumes it after a restart), to
        another decode worker."""
        s = self._s
        if s.call is not None:
            s.call.cancel()
        self._release_slot()
        s.placement = None
        self._open_generate(None)

    # -- steps -------------------------------------------------------------------------------------------------

    def _decode_may_prefill(self, why: str) -> bool:
        """No prefill worker can take the prompt (`why`): may the decode worker compute it itself (skip-P, exact as
        colocated), as the operator's skip_prefill allows? Keeps the cluster serving while every prefill worker is
        down or restarting, whatever the routing policy."""
        if self.cluster.config.routing_weights.skip_prefill == "never":
            return False
        log.warning("request %s: %s; the decode worker computes the prompt itself", self.req.request_id, why)
        return True

    async def _prefill(self, router: Router) -> pb.PrefillResponse | None:
        """P.Prefill on the placed or a chosen prefill worker, another after one that is down or frozen. None: no
        prefill worker is up and the decode worker may compute the prompt itself (`_decode_may_prefill`)."""
        req = pb.PrefillRequest(
            request_id=self.req.request_id,
            prompt_token_ids=self.req.prompt_token_ids,
            sampling_params=to_proto_sampling(self.req.sampling),
            cache_salt=self.req.cache_salt,
        )
        cfg = self.cluster.config
        refused: set[str] = set()
        placed = self._s.placement.prefill_addr if self._s.placement is not None else None
        tokens = len(self.req.prompt_token_ids)
        while True:
            timeout = min(cfg.prefill_timeout_s, self._remaining("a prefill worker"))
            try:
                if placed is not None and placed not in refused and router.is_routable(placed):
                    addr = router.take(placed, tokens)
                else:
                    addr = router.acquire(exclude=refused, tokens=tokens)
            except NoWorkerError:
                if self._decode_may_prefill("no prefill worker is available"):
                    return None
                raise self._fail(ApiError(503, "no prefill worker is available", code="worker_unavailable")) from None
            self._s.prefill_addr = addr
            t0 = time.perf_counter()
            try:
                resp = await _prefill_unless_frozen(self.cluster.clients, router, addr, req, timeout)
                break
            except _WorkerFrozen:
                log.warning(
                    "request %s: prefill worker %s stopped answering; trying another", self.req.request_id, addr
                )
                self.cluster.metrics.prefill_failovers.labels(cause="frozen").inc()
                refused.add(addr)
                continue
            except grpc.aio.AioRpcError as err:
                if err.code() not in _RETRY_ON_ANOTHER_PREFILL:
                    raise self._fail(from_rpc_error(err, "prefill", addr)) from None
                cause = "lost" if err.code() == grpc.StatusCode.UNAVAILABLE else "busy"
                self.cluster.metrics.prefill_failovers.labels(cause=cause).inc()
                refused.add(addr)
                if any(a not in refused for a in router.addrs):  # (`addr` itself may be marked down by now)
                    continue
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    if self._decode_may_prefill(f"no prefill worker answers ({addr}: {err.details()})"):
                        return None
                    raise self._fail(from_rpc_error(err, "prefill", addr)) from None
                raise self._fail(
                    ApiError(
                        503,
                        f"every prefill worker is at capacity ({err.details()}); retry later",
                        code="overloaded",
                        headers={"Retry-After": str(cfg.retry_after_s)},
                    )
                ) from None
            finally:
                router.release(addr, tokens)
        elapsed = time.perf_counter() - t0
        self.cluster.metrics.prefill_rpc.observe(elapsed)
        placer, placed_on = self.cluster.placer, self._s.placement
        if placer is not None:
            placer.costs.prefill_done(elapsed, tokens - resp.num_cached_tokens)
            if placed_on is not None:
                placer.expect(addr, placed_on.hashes, tokens, resp.params.checkpoint_num_tokens)
        self._s.prefilled = resp.HasField("params")
        self._s.prefill_epoch = resp.params.epoch
        self._s.lease_token = resp.params.lease_token
        self.usage.prefill_cached_tokens = resp.num_cached_tokens
        first = resp.first
        if len(first.token_ids) != 1 or (not first.finish_reason and not resp.HasField("params")):
            self._release_prefill()
            raise self._fail(
                ApiError(
                    500,
                    f"prefill worker {addr} answered without its first token or, for a "
                    "request that goes on, without transfer params",
                    code="worker_error",
                )
            )
        return resp

    def _params(self, resp: pb.PrefillResponse) -> pb.TransferParams:
        params = pb.TransferParams()
        params.CopyFrom(resp.params)
        if not params.prefill_address:
            assert self._s.prefill_addr is not None
            params.prefill_address = self._s.prefill_addr
        return params

    def _open_generate(self, params: pb.TransferParams | None) -> None:
        timeout = self._remaining("a decode worker")
        decode, placed, prefill = self.cluster.decode, self._s.placement, self.cluster.prefill
        self._s.on_prefill = False
        try:
            if (
                placed is not None
                and placed.on_prefill
                and prefill is not None
                and prefill.is_routable(placed.decode_addr)
            ):  # P-alone: the whole request on a prefill worker
                n = len(self.req.prompt_token_ids)
                addr = prefill.take(placed.decode_addr, n)
                self._s.on_prefill, self._s.queued_tokens = True, n
                if self.cluster.placer is not None:
                    self.cluster.placer.whole_started(addr)
            elif (
                placed is not None
                and not placed.on_prefill
                and placed.decode_addr not in self._s.decode_tried
                and decode.is_routable(placed.decode_addr)
            ):
                addr = decode.take(placed.decode_addr)
            else:
                addr = decode.acquire(exclude=self._s.decode_tried)
        except NoWorkerError:
            self._release_prefill()
            raise self._fail(ApiError(503, "no decode worker is available", code="worker_unavailable")) from None
        self._s.decode_addr = addr
        self._s.decode_slot_released = False
        self._s.generate_sent = time.perf_counter()
        req = pb.GenerateRequest(
            request_id=self.req.request_id,
            prompt_token_ids=self.req.prompt_token_ids,
            sampling_params=to_proto_sampling(self.req.sampling),
            cache_salt=self.req.cache_salt,
        )
        if params is not None:
            req.params.CopyFrom(params)
        sent = self._sent
        if self.restarts and sent.token_ids:  # resumed: D continues after everything already sent
            req.first_token.token_id, req.first_token.logprob = sent.token_ids[0], sent.first_logprob
            req.resume.token_ids.extend(sent.token_ids[1:])
            req.resume.text_chars = sent.text_chars
        elif self._s.first_token is not None:
            req.first_token.CopyFrom(self._s.first_token)
        self._s.paced = False
        self._s.call = self.cluster.clients.generate(addr, req, timeout)
        if self.cluster.placer is not None and placed is not None:
            n = len(self.req.prompt_token_ids)  # D keeps P's checkpoint, or (computing itself) its prompt end's
            ckpt = params.checkpoint_num_tokens if params is not None else n - 1
            self.cluster.placer.expect(addr, placed.hashes, n, ckpt)

    async def _next_delta(self) -> Delta:
        """Read chunks until one carries tokens or a finish reason."""
        assert self._s.call is not None and self._s.decode_addr is not None
        while True:
            try:
                chunk = await (self._read_unless_stalled() if self._s.got_chunk else self._first_read_unless_frozen())
            except _WorkerStalled as stalled:
                # alive: it frees the request once it sees this (or the cancelled stream)
                self.cluster.clients.abort_later(self._s.decode_addr, self.req.request_id)
                if self._resume_elsewhere("stalled"):
                    continue
                raise self._fail(
                    ApiError(503, f"decode worker {self._s.decode_addr} {stalled}", code="worker_unavailable")
                ) from None
            except _WorkerFrozen:
                self._release_prefill()  # D never took over P's lease (a pull it started is refused at Commit)
                if self._retry_decode(grpc.StatusCode.UNAVAILABLE):
                    self.cluster.metrics.decode_failover("stalled", "resumed")
                    continue
                self.cluster.metrics.decode_failover("stalled", "failed")
                raise self._fail(
                    ApiError(503, f"decode worker {self._s.decode_addr} stopped answering", code="worker_unavailable")
                ) from None
            except grpc.aio.AioRpcError as err:
                if not self._s.got_chunk:
                    self._release_prefill()  # D failed before taking over P's lease
                    if self._retry_decode(err.code()):
                        continue
                elif err.code() == grpc.StatusCode.UNAVAILABLE and self._resume_elsewhere("lost"):
                    continue
                raise self._fail(from_rpc_error(err, "decode", self._s.decode_addr)) from None
            if chunk is grpc.aio.EOF:
                raise self._fail(
                    ApiError(
                        500,
                        f"decode worker {self._s.decode_addr} ended the stream without a finish reason",
                        code="worker_error",
                    )
                )
            if not self._s.got_chunk and self.restarts and chunk.num_resumed_tokens != len(self._sent.token_ids):
                raise self._fail(
                    ApiError(
                        500,
                        f"decode worker {self._s.decode_addr} did not resume the request after "
                        f"its {len(self._sent.token_ids)} output tokens (a worker that predates "
                        "resuming?)",
                        code="worker_error",
                    )
                )
            self._s.got_chunk = True
            if chunk.finish_reason == "abort":  # D aborted it (not our client): an error, not a short answer
                self._s.finished = True
                raise self._fail(
                    ApiError(503, f"decode worker {self._s.decode_addr} aborted the request", code="aborted")
                )
            delta = self._absorb(chunk)
            if delta.token_ids or delta.finish_reason:
                return delta

    async def _read_unless_stalled(self) -> Any:
        """The Generate stream's next read after its first; _WorkerStalled once it brings nothing for the
        configured inter-token timeout (0: wait as long as the request's deadline allows) or, from a decode worker,
        once the health monitor finds it unresponsive while another decode worker answers (`Router.watch`: a
        frozen process is left within a probe or two, not only after the timeout)."""
        s, limit = self._s, self.cluster.config.inter_token_timeout_s
        assert s.call is not None and s.decode_addr is not None
        router, addr = (None if s.on_prefill else self.cluster.decode), s.decode_addr
        woken: list[bool] = []
        try:
            async with asyncio.timeout(limit or None) as timer:
                if router is None:
                    return await s.call.read()

                def wake() -> None:
                    woken.append(True)
                    timer.reschedule(asyncio.get_running_loop().time())

                router.watch(addr, wake)
                try:
                    return await s.call.read()
                finally:
                    router.unwatch(addr, wake)
        except TimeoutError:
            why = "stopped answering health probes" if woken else f"made no progress for {limit:g} s"
            raise _WorkerStalled(why) from None

    async def _first_read_unless_frozen(self) -> Any:
        """The Generate stream's first read; _WorkerFrozen (the stream cancelled) once the health monitor finds its
        decode worker unresponsive while another decode worker not tried yet answers."""
        s, router = self._s, self.cluster.decode
        assert s.call is not None and s.decode_addr is not None
        if s.on_prefill or len(router.members) < 2:
            return await s.call.read()
        read = asyncio.ensure_future(s.call.read())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=FROZEN_CHECK_S)
                if done:
                    return read.result()
                if router.is_unresponsive(s.decode_addr) and any(
                    a not in (*s.decode_tried, s.decode_addr) for a in router.addrs
                ):
                    raise _WorkerFrozen(s.decode_addr)
        finally:
            if not read.done():
                read.cancel()

    def _retry_decode(self, code: grpc.StatusCode) -> bool:
        """Generate failed with `code` before sending anything: D was unreachable, or (P-alone) the prefill worker
        was down, at its mixed-role cap or without that role. Send the request (without P's params: D computes the
        prompt, and P's first token when there is one, itself) to another decode worker. False when there is none
        left or the failure is not one to retry."""
        s = self._s
        failed = s.decode_addr
        if s.on_prefill:
            if code not in _WHOLE_ELSEWHERE or not self.cluster.decode.addrs:
                return False
            log.info(
                "prefill worker %s did not take %s whole (%s): sent to a decode worker",
                failed,
                self.req.request_id,
                code.name,
            )
        else:
            if code != grpc.StatusCode.UNAVAILABLE or not self._another_decode_left():
                return False
            log.warning(
                "decode worker %s unreachable before the first token of %s: retrying elsewhere",
                failed,
                self.req.request_id,
            )
        self._send_elsewhere()
        return True

    def _release_slot(self) -> None:
        """Give back the Generate worker's in-flight count (exactly once per Generate sent)."""
        s = self._s
        if s.decode_addr is None or s.decode_slot_released:
            return
        s.decode_slot_released = True
        if not s.on_prefill:
            self.cluster.decode.release(s.decode_addr)
            return
        assert self.cluster.prefill is not None
        self.cluster.prefill.release(s.decode_addr, s.queued_tokens)
        s.queued_tokens = 0
        if self.cluster.placer is not None:
            self.cluster.placer.whole_ended(s.decode_addr)

    def _absorb(self, chunk: pb.GenerateChunk, from_decode: bool = True) -> Delta:
        """One chunk of output: D's, or (`from_decode` False) P's first token."""
        now = time.perf_counter()
        n = len(chunk.token_ids)
        m = self.cluster.metrics
        if n:
            if self._t.first_token is None:
                self._t.first_token = now
                m.ttft.observe(now - self._t.arrival)
            else:
                assert self._t.last_token is not None
                for _ in range(n):
                    m.itl.observe((now - self._t.last_token) / n)
                if from_decode and self._s.paced and self.cluster.placer is not None:
                    assert self._s.decode_addr is not None  # its stream's pace (its first chunk's gap excluded)
                    self.cluster.placer.costs.token_gap(self._s.decode_addr, (now - self._t.last_token) / n)
            self._t.last_token = now
            self._s.paced = self._s.paced or from_decode
            sent = self._sent
            if not sent.token_ids and chunk.logprobs:
                sent.first_logprob = chunk.logprobs[0]
            sent.token_ids.extend(chunk.token_ids)
            if from_decode and not self._s.decode_routed:
                self._s.decode_routed = True
                self._first_token_routed(chunk, now)
        self._sent.text_chars += len(chunk.text)
        u = self.usage
        u.completion_tokens += n
        if not self.restarts:  # (a resumed decode worker computed the prompt again: usage tells how it was served)
            u.prompt_tokens = chunk.num_prompt_tokens or u.prompt_tokens
            u.cached_tokens = chunk.num_cached_tokens or u.cached_tokens
            u.external_cached_tokens = chunk.num_external_cached_tokens or u.external_cached_tokens
        finish = chunk.finish_reason or None
        if finish is not None:
            self._finish(now)
        return Delta(
            tuple(chunk.token_ids),
            chunk.text,
            tuple(chunk.logprobs),
            finish,
            top_logprobs_of(chunk),
            stop_reason_of(chunk),
            prompt_logprobs_of(chunk),
        )

    def _first_token_routed(self, chunk: pb.GenerateChunk, now: float) -> None:
        """D's first output: record the routing decision against what D really found, and feed the measured step
        costs (under PD, the handoff: Generate sent to D's first token, the second of the request)."""
        s, cluster = self._s, self.cluster
        real_hit = chunk.num_cached_tokens - chunk.num_external_cached_tokens
        path = (
            "colocated"
            if cluster.prefill is None
            else "prefill_alone"
            if s.on_prefill
            else "pd"
            if s.prefilled
            else "skip_prefill"
        )
        expected = s.placement.expected_hit if s.placement is not None else 0
        cluster.metrics.route(path, expected, real_hit)
        if s.prefilled and not chunk.num_external_cached_tokens:
            # D computed the prompt itself (P unknown or unreachable, no room to receive, params refused, pull
            # failed): nothing of P's lease is read (output from a pull is held back until P's Commit, so a chunk
            # means any Commit is answered). Give it back now, not at its expiry: P's pinned pages bound its work.
            self._release_prefill()
        if s.on_prefill and s.queued_tokens:  # its prompt is computed: out of the prefill worker's queue
            assert cluster.prefill is not None and s.decode_addr is not None
            cluster.prefill.settle(s.decode_addr, s.queued_tokens)
            s.queued_tokens = 0
        placer = cluster.placer
        if placer is not None:
            elapsed = now - s.generate_sent
            computed = chunk.num_prompt_tokens - chunk.num_cached_tokens
            if path == "pd":
                placer.costs.handoff_done(elapsed)
            elif path == "skip_prefill":
                placer.costs.local_prefill_done(elapsed, computed)
            elif path == "prefill_alone":  # P's queue and prefill, as a Prefill call measures them
                placer.costs.prefill_done(elapsed, computed)
        log.debug(
            "route %s: %s P=%s D=%s expected_hit=%d real_hit=%d (%s)",
            self.req.request_id,
            path,
            s.prefill_addr if s.prefilled else "-",
            s.decode_addr,
            expected,
            real_hit,
            s.placement.reason if s.placement is not None else cluster.config.routing,
        )

    def _finish(self, now: float) -> None:
        self._s.finished = True
        m = self.cluster.metrics
        m.e2e.observe(now - self._t.arrival)
        m.prompt_tokens.inc(self.usage.prompt_tokens)
        m.generation_tokens.inc(self.usage.completion_tokens)
        m.cached_tokens.inc(self.usage.cached_tokens)
        m.prefill_cached_tokens.inc(self.usage.prefill_cached_tokens)
        self._record("success")

    # -- failure and cleanup -----------------------------------------------------------------------------------

    def _record(self, status: str) -> None:
        if self._s.status is None:
            self._s.status = status
            self.cluster.metrics.count(status)

    def _fail(self, err: ApiError) -> ApiError:
        self._record("invalid" if err.status < 500 else "error")
        err.counted = True
        return err

    def _release_prefill(self) -> None:
        s = self._s
        if s.prefilled and s.prefill_addr is not None and not s.prefill_released:
            s.prefill_released = True
            self.cluster.clients.release_later(s.prefill_addr, self.req.request_id, s.prefill_epoch, s.lease_token)

    def record_error(self) -> None:
        """An unexpected failure mid-stream (not a worker's status): count it once as an error."""
        self._record("error")

    def close(self) -> None:
        """Idempotent, never blocks. Unfinished: cancel the stream, abort on D (or release on P), count 'aborted'."""
        s = self._s
        if s.call is None:
            self._release_prefill()  # prefilled but Generate never sent (client gone, deadline, no decode worker)
        if not s.finished and s.status is None:
            self._record("aborted")
            if s.call is None:
                if s.prefill_addr is not None and not s.prefilled:  # cancelled mid-Prefill: P may still finish
                    self.cluster.clients.release_later(s.prefill_addr, self.req.request_id, "")
            else:
                assert s.decode_addr is not None
                self.cluster.clients.abort_later(s.decode_addr, self.req.request_id)
                if not s.got_chunk:  # gone after P's first token: D may never have taken over P's lease
                    self._release_prefill()  # (a READ it started is refused at Commit: P's pages are never used)
        if s.call is not None and not s.call.done():
            s.call.cancel()
        self._release_slot()
