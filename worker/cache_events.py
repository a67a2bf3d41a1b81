"""A worker's cache-event stream (`CacheEvents` RPC): a snapshot, then batches of events, to every subscriber.

One `CacheEventHub` per worker drains the engine's `CacheEventLog` (engine/cache/events.py) every `interval_s`
while someone listens and fans the batch out to each subscriber's queue. A subscriber first gets a snapshot
(`cached_hashes()` and the log's sequence number, taken on the step thread) and then every batch, with the events
it already saw in the snapshot skipped. After a log overflow (events dropped) every subscriber gets a new snapshot.

Ownership: the hub lives on the worker's event loop; the engine's cache appends on the step thread (the log locks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from hybridpd.proto import hybridpd_pb2 as pb

log = logging.getLogger(__name__)

_QUEUE_LIMIT = 256
"""Batches a slow subscriber may fall behind before it is resynced from a snapshot instead."""


def _shape(cache) -> pb.CacheShape:  # type: ignore[no-untyped-def]
    return pb.CacheShape(
        block_size=cache.block_size,
        attention_groups=list(cache.attention_groups),
        recurrent_groups=list(cache.recurrent_groups),
        checkpoint_align=cache.align if cache.recurrent_groups else cache.block_size,
    )


class CacheEventHub:
    def __init__(self, ctx, interval_s: float = 0.05) -> None:  # type: ignore[no-untyped-def]
        self.ctx = ctx
        self.interval_s = interval_s
        self._subscribers: set[asyncio.Queue[pb.CacheEventBatch | None]] = set()
        self._task: asyncio.Task[None] | None = None

    async def snapshot(self) -> pb.CacheEventBatch:
        def take(core):  # type: ignore[no-untyped-def]  # step thread: no event lands between the two reads
            cache = core.cache
            return cache.events.seq, cache.cached_hashes(), _shape(cache)

        seq, groups, shape = await self.ctx.aengine.acall(take)
        return pb.CacheEventBatch(
            epoch=self.ctx.epoch,
            first_seq=seq,
            snapshot=True,
            shape=shape,
            groups=[pb.GroupHashes(group=g, block_hashes=sorted(h)) for g, h in groups.items()],
        )

    def _log(self):  # type: ignore[no-untyped-def]
        return self.ctx.aengine.core.cache.events

    async def _pump(self) -> None:
        while self._subscribers:
            await asyncio.sleep(self.interval_s)
            first, events, lost = self._log().drain_from()
            if lost:
                self._broadcast(None)  # None: resync from a snapshot
                continue
            if not events:
                continue
            batch = pb.CacheEventBatch(
                epoch=self.ctx.epoch,
                first_seq=first,
                events=[pb.CacheEvent(stored=e.stored, group=e.group, block_hash=e.block_hash) for e in events],
            )
            self._broadcast(batch)
        self._task = None

    def _broadcast(self, batch: pb.CacheEventBatch | None) -> None:
        for q in self._subscribers:
            if batch is not None and q.qsize() >= _QUEUE_LIMIT:
                while not q.empty():
                    q.get_nowait()
                batch_for_q = None
            else:
                batch_for_q = batch
            q.put_nowait(batch_for_q)

    async def stream(self) -> AsyncGenerator[pb.CacheEventBatch, None]:
        q: asyncio.Queue[pb.CacheEventBatch | None] = asyncio.Queue()
        if not self._subscribers:
            self._log().drain_from()  # nobody listened: what is queued is older than the snapshot below
        self._subscribers.add(q)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())
        try:
            snap = await self.snapshot()
            seen = snap.first_seq
            yield snap
            while True:
                batch = await q.get()
                if batch is None:
                    snap = await self.snapshot()
                    seen = snap.first_seq
                    yield snap
                    continue
                end = batch.first_seq + len(batch.events)
                if end <= seen:
                    continue  # entirely inside the snapshot
                if batch.first_seq < seen:  # partly: keep the events after the snapshot
                    keep = batch.events[seen - batch.first_seq :]
                    batch = pb.CacheEventBatch(epoch=batch.epoch, first_seq=seen, events=keep)
                seen = end
                yield batch
        finally:
            self._subscribers.discard(q)
