"""One background task per worker that keeps the worker's `WorkerCacheIndex` fed from its `CacheEvents` stream.

    connect -> snapshot (index rebuilt, worker marked up) -> batches applied in order -> ...
    stream error / worker gone        -> index marked stale, `on_down(addr)`, reconnect after a short backoff
    gap in sequence numbers, epoch change (worker restarted) -> reconnect at once: the new stream starts with a
                                         snapshot

`drop_fraction` silently leaves out that share of events (sequence numbers stay contiguous, so the index cannot
notice): a test knob for lossy event delivery, never set in production. Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import grpc
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proxy.cache_index import CacheShape, WorkerCacheIndex
from hybridpd.proxy.workers import Role, WorkerClients

log = logging.getLogger(__name__)


def _shape(msg: pb.CacheShape) -> CacheShape:
    return CacheShape(
        block_size=msg.block_size,
        attention_groups=tuple(msg.attention_groups),
        recurrent_groups=tuple(msg.recurrent_groups),
        align=msg.checkpoint_align or msg.block_size,
    )


class CacheFeed:
    """Streams one worker's cache events into `index` until `stop()`."""

    def __init__(
        self,
        clients: WorkerClients,
        role: Role,
        addr: str,
        on_up: Callable[[str, str], None],
        on_down: Callable[[str], None],
        drop_fraction: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self.clients, self.role, self.addr = clients, role, addr
        self.index: WorkerCacheIndex | None = None
        self.connected = False
        self.resyncs = 0
        self._on_up, self._on_down = on_up, on_down
        self._drop = drop_fraction
        self._rng = random.Random(seed)
        self._task: asyncio.Task[None] | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def usable(self) -> WorkerCacheIndex | None:
        """The index when it can be trusted for routing (connected, snapshot received), else None."""
        return self.index if self.connected and self.index is not None else None

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            try:
                await self._follow()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker %s streams no cache events: routing it by load only", self.addr)
                    self._set_down(report=False)
                    return
                self._set_down()
            except Exception:  # noqa: BLE001 - the feed must outlive any bad message
                log.exception("cache-event feed of %s failed", self.addr)
                self._set_down()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 1.0)

    def _set_down(self, report: bool = True) -> None:
        was = self.connected
        self.connected = False
        if self.index is not None:
            self.index.mark_stale()
        if was and report:
            self._on_down(self.addr)

    async def _follow(self) -> None:
        """Read one stream until it ends or needs a resync (returns then)."""
        self._call = call = self.clients.cache_events(self.role, self.addr)
        try:
            async for msg in call:
                if msg.snapshot:
                    self._load(msg)
                    continue
                index = self.index
                if index is None or msg.epoch != index.epoch:
                    self.resyncs += 1
                    return  # restarted worker: reconnect for a snapshot of the new epoch
                kept = [
                    (e.stored, e.group, e.block_hash)
                    for e in msg.events
                    if not self._drop or self._rng.random() >= self._drop
                ]
                if not index.apply(msg.first_seq, kept, count=len(msg.events)):
                    self.resyncs += 1
                    return  # missed events: reconnect, the new stream starts with a snapshot
        finally:
            call.cancel()
            self._call = None
        raise ConnectionError(f"cache-event stream of {self.addr} ended")

    def _load(self, msg: pb.CacheEventBatch) -> None:
        shape = _shape(msg.shape)
        if self.index is None or self.index.shape != shape:
            self.index = WorkerCacheIndex(shape)
        self.index.load_snapshot(msg.epoch, msg.first_seq, {g.group: g.block_hashes for g in msg.groups})
        self.connected = True
        self._on_up(self.addr, msg.epoch)
