"""Async gRPC clients to prefill and decode workers: one `grpc.aio` channel per address, reused for the app's life.

Ownership: `WorkerClients` owns the channels (created lazily on the event loop, closed by `close()`) and the
fire-and-forget cleanup tasks (`abort_later`, `release_later`), which must never be awaited from a cancelled
request (a disconnected client's task is cancelled and keeps being cancelled at every await).

Every call goes through this class: each carries the cluster token as metadata `x-hybridpd-token` (when the
proxy has one) and a deadline (the request's remaining time, or the control timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Literal

import grpc
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc
from hybridpd.proxy.credentials import token_metadata, worker_channel_credentials

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # a restarted worker is back on the same port within seconds: reconnect within about a second of that, not
    # after gRPC's default backoff (up to 120 s, during which every call fails at once with UNAVAILABLE)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def max_message_bytes() -> int:
    """The largest message a worker channel receives (a worker's chunk: its prompt scores ride on one)."""
    return int(dict(_CHANNEL_OPTIONS)["grpc.max_receive_message_length"])


def prompt_scores_bytes(num_tokens: int, k: int) -> int:
    """An upper bound on the wire size of `num_tokens` prompt positions' scores with `k` alternatives each
    (`PromptLogprob`: token id, logprob, rank and the packed top-k; varints of token ids and ranks below 2^28): one
    GenerateChunk carries them all."""
    return num_tokens * (24 + 9 * k)


class WorkerClients:
    """Stubs for every worker address; the app holds one instance."""

    def __init__(self, control_timeout_s: float = 5.0, cluster_token: str | None = None) -> None:
        self.control_timeout_s = control_timeout_s
        self.metadata = token_metadata(cluster_token)
        self._tls = worker_channel_credentials()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task[Any]] = set()

    def channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            ch = grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS) if self._tls is None else \
                grpc.aio.secure_channel(addr, self._tls, options=_CHANNEL_OPTIONS)
            self._channels[addr] = ch
        return ch

    def prefill(self, addr: str) -> pb_grpc.PrefillServiceStub:
        return pb_grpc.PrefillServiceStub(self.channel(addr))

    def decode(self, addr: str) -> pb_grpc.DecodeServiceStub:
        return pb_grpc.DecodeServiceStub(self.channel(addr))

    def _stub(self, role: Role, addr: str) -> pb_grpc.PrefillServiceStub | pb_grpc.DecodeServiceStub:
        return self.prefill(addr) if role == "prefill" else self.decode(addr)

    async def health(self, role: Role, addr: str) -> pb.HealthResponse:
        return await self._stub(role, addr).Health(pb.HealthRequest(), timeout=self.control_timeout_s,
                                                   metadata=self.metadata)

    async def stats(self, role: Role, addr: str) -> pb.StatsResponse:
        return await self._stub(role, addr).Stats(pb.StatsRequest(), timeout=self.control_timeout_s,
                                                  metadata=self.metadata)

    async def drain_worker(self, role: Role, addr: str, drain: bool) -> pb.DrainResponse:
        return await self._stub(role, addr).Drain(pb.DrainRequest(drain=drain), timeout=self.control_timeout_s,
                                                  metadata=self.metadata)

    def cache_events(self, role: Role, addr: str) -> grpc.aio.UnaryStreamCall:
        """The worker's cache-event stream (a snapshot, then batches); open until cancelled."""
        return self._stub(role, addr).CacheEvents(pb.CacheEventsRequest(), metadata=self.metadata)

    async def prefill_call(self, addr: str, req: pb.PrefillRequest, timeout: float) -> pb.PrefillResponse:
        """P.Prefill with a deadline of `timeout` seconds."""
        return await self.prefill(addr).Prefill(req, timeout=timeout, metadata=self.metadata)

    def generate(self, addr: str, req: pb.GenerateRequest, timeout: float) -> grpc.aio.UnaryStreamCall:
        """D.Generate (a server stream) that the worker ends after `timeout` seconds at the latest."""
        return self.decode(addr).Generate(req, timeout=timeout, metadata=self.metadata)

    # -- cleanup that must outlive a cancelled request -----------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort_later(self, addr: str, request_id: str) -> None:
        """Ask decode worker `addr` to abort `request_id` (idempotent on the worker)."""

        async def abort() -> None:
            try:
                await self.decode(addr).Abort(pb.AbortRequest(request_id=request_id), timeout=self.control_timeout_s,
                                              metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                log.warning("Abort(%s) on decode %s failed: %s", request_id, addr, err.code().name)

        self.spawn(abort())

    def release_later(self, addr: str, request_id: str, epoch: str, lease_token: str = "") -> None:
        """Ask prefill worker `addr` to drop the lease of `request_id` (idempotent on the worker)."""

        async def release() -> None:
            try:
                req = pb.ReleaseRequest(request_id=request_id, epoch=epoch, lease_token=lease_token)
                await self.prefill(addr).Release(req, timeout=self.control_timeout_s, metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                log.warning("Release(%s) on prefill %s failed: %s", request_id, addr, err.code().name)

        self.spawn(release())

    async def drain(self) -> None:
        """Wait for the background cleanup calls issued so far."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
