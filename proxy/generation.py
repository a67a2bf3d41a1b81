"""One request's trip through the cluster: pick workers, P.Prefill (unless colocated), then the D.Generate stream.

    proxy                      prefill worker P               decode worker D
      | Prefill(ids, sampling) ---> |  computes N-1 tokens, pins blocks under a lease
      | <--- TransferParams ------- |
      | Generate(ids, sampling, params) --------------------------> |  pulls from P, releases P's lease
      | <--- GenerateChunk ... GenerateChunk(finish_reason) ------- |

Ownership of P's lease (see the contract on `DecodeService` in hybridpd.proto):
  - Generate never sent (client gone, or no decode worker)    -> the proxy calls P.Release;
  - Generate ended with an error status before any chunk      -> D holds no reads of P's blocks: P.Release;
  - otherwise D owns it; a client disconnect only sends D.Abort (D stops its pulls and releases P).
Cleanup RPCs run in the background (`WorkerClients.abort_later/release_later`): `close()` never awaits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from proto import hybridpd_pb2 as pb
from proxy.config import ProxyConfig
from proxy.errors import ApiError, from_rpc_error
from proxy.metrics import ProxyMetrics
from proxy.openai_schema import SamplingOptions
from proxy.routing import Router
from proxy.workers import WorkerClients


@dataclass(frozen=True)
class Cluster:
    """What every request shares: config, gRPC clients, one router per role, metrics. Owned by the app."""

    config: ProxyConfig
    clients: WorkerClients
    prefill: Router | None  # None when colocated
    decode: Router
    metrics: ProxyMetrics


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for the workers (`max_tokens` already resolved)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    cache_salt: str = ""


@dataclass(frozen=True)
class Delta:
    """New output since the previous delta; `finish_reason` is set on the last one."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: str | None


@dataclass
class Usage:
    """Token counts of one request. `cached_tokens` is D's `num_cached_tokens`: prompt tokens D did not compute
    (its local prefix hit plus tokens pulled from P); `external_cached_tokens` is the pulled part;
    `prefill_cached_tokens` is P's own prefix hit (0 when colocated)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    external_cached_tokens: int = 0
    prefill_cached_tokens: int = 0


def to_proto_sampling(s: SamplingOptions) -> pb.SamplingParams:
    if s.max_tokens is None:
        raise ValueError("max_tokens must be resolved before the request reaches a worker")
    msg = pb.SamplingParams(max_tokens=s.max_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                            ignore_eos=s.ignore_eos, logprobs=s.logprobs)
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(s, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None
    first_token: float | None = None


@dataclass
class _State:
    prefill_addr: str | None = None
    prefill_epoch: str = ""
    prefilled: bool = False
    decode_addr: str | None = None
    call: grpc.aio.UnaryStreamCall | None = None
    got_chunk: bool = False
    finished: bool = False
    status: str | None = None  # metrics status, set once
    prefill_released: bool = False  # P.Release sent (at most once)
    decode_slot_released: bool = False  # the decode router's in-flight count given back (exactly once)


class Generation:
    """Drives one request. Lifecycle:

        first = await gen.start()      # route + prefill + first output; raises ApiError before anything is sent
        async for delta in gen.rest(): # later output; raises ApiError on a mid-stream worker failure
        gen.close()                    # always (finally): aborts / releases if unfinished, records metrics
    """

    def __init__(self, cluster: Cluster, req: PreparedRequest, arrival: float) -> None:
        self.cluster = cluster
        self.req = req
        self.usage = Usage(prompt_tokens=len(req.prompt_token_ids))
        self._t = _Timing(arrival=arrival)
        self._s = _State()

    @property
    def finished(self) -> bool:
        return self._s.finished

    async def start(self) -> Delta:
        params = None if self.cluster.prefill is None else await self._prefill(self.cluster.prefill)
        self._open_generate(params)
        return await self._next_delta()

    async def rest(self) -> AsyncIterator[Delta]:
        while not self._s.finished:
            yield await self._next_delta()

    async def collect(self) -> list[Delta]:
        """start() and rest() in one list (non-streaming responses)."""
        deltas = [await self.start()]
        deltas.extend([d async for d in self.rest()])
        return deltas

    # -- steps -------------------------------------------------------------------------------------------------

    async def _prefill(self, router: Router) -> pb.TransferParams:
        addr = router.acquire()
        self._s.prefill_addr = addr
        req = pb.PrefillRequest(request_id=self.req.request_id, prompt_token_ids=self.req.prompt_token_ids,
                                sampling_params=to_proto_sampling(self.req.sampling), cache_salt=self.req.cache_salt)
        t0 = time.perf_counter()
        try:
            resp = await self.cluster.clients.prefill(addr).Prefill(req, timeout=self.cluster.config.prefill_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise self._fail(from_rpc_error(err, "prefill", addr)) from None
        finally:
            router.release(addr)
        self.cluster.metrics.prefill_rpc.observe(time.perf_counter() - t0)
        self._s.prefilled = True
        self._s.prefill_epoch = resp.params.epoch
        self.usage.prefill_cached_tokens = resp.num_cached_tokens
        params = pb.TransferParams()
        params.CopyFrom(resp.params)
        if not params.prefill_address:
            params.prefill_address = addr
        return params

    def _open_generate(self, params: pb.TransferParams | None) -> None:
        addr = self.cluster.decode.acquire()
        self._s.decode_addr = addr
        req = pb.GenerateRequest(request_id=self.req.request_id, prompt_token_ids=self.req.prompt_token_ids,
                                 sampling_params=to_proto_sampling(self.req.sampling), cache_salt=self.req.cache_salt)
        if params is not None:
            req.params.CopyFrom(params)
        self._s.call = self.cluster.clients.decode(addr).Generate(req)

    async def _next_delta(self) -> Delta:
        """Read chunks until one carries tokens or a finish reason."""
        assert self._s.call is not None and self._s.decode_addr is not None
        while True:
            try:
                chunk = await self._s.call.read()
            except grpc.aio.AioRpcError as err:
                if not self._s.got_chunk:
                    self._release_prefill()  # D failed before taking over P's lease
                raise self._fail(from_rpc_error(err, "decode", self._s.decode_addr)) from None
            if chunk is grpc.aio.EOF:
                raise self._fail(ApiError(500, f"decode worker {self._s.decode_addr} ended the stream without a "
                                               "finish reason", code="worker_error"))
            self._s.got_chunk = True
            delta = self._absorb(chunk)
            if delta.token_ids or delta.finish_reason:
                return delta

    def _absorb(self, chunk: pb.GenerateChunk) -> Delta:
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
            self._t.last_token = now
        u = self.usage
        u.completion_tokens += n
        u.prompt_tokens = chunk.num_prompt_tokens or u.prompt_tokens
        u.cached_tokens = chunk.num_cached_tokens or u.cached_tokens
        u.external_cached_tokens = chunk.num_external_cached_tokens or u.external_cached_tokens
        finish = chunk.finish_reason or None
        if finish is not None:
            self._finish(now)
        return Delta(tuple(chunk.token_ids), chunk.text, tuple(chunk.logprobs), finish)

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
        return err

    def _release_prefill(self) -> None:
        s = self._s
        if s.prefilled and s.prefill_addr is not None and not s.prefill_released:
            s.prefill_released = True
            self.cluster.clients.release_later(s.prefill_addr, self.req.request_id, s.prefill_epoch)

    def close(self) -> None:
        """Idempotent, never blocks. Unfinished: cancel the stream, abort on D (or release on P), count 'aborted'."""
        s = self._s
        if not s.finished and s.status is None:
            self._record("aborted")
            if s.call is None:
                self._release_prefill()
                if s.prefill_addr is not None and not s.prefilled:  # cancelled mid-Prefill: P may still finish
                    self.cluster.clients.release_later(s.prefill_addr, self.req.request_id, "")
            else:
                assert s.decode_addr is not None
                self.cluster.clients.abort_later(s.decode_addr, self.req.request_id)
        if s.call is not None and not s.call.done():
            s.call.cancel()
        if s.decode_addr is not None and not s.decode_slot_released:
            s.decode_slot_released = True
            self.cluster.decode.release(s.decode_addr)
