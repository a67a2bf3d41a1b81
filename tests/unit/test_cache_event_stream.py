"""The worker's cache-event stream (worker/cache_events.py) against a stand-in cache: a snapshot first, then
batches with contiguous sequence numbers, a fresh snapshot after the log overflowed, events a snapshot already holds
skipped, and two subscribers served alike."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from hybridpd.engine.cache.events import CacheEventLog
from hybridpd.worker.cache_events import CacheEventHub


class _Cache:
    """What the hub reads of a HybridCacheManager: events, cached_hashes(), block size, group ids and the checkpoint
    alignment."""

    def __init__(self, capacity: int) -> None:
        self.events = CacheEventLog(capacity)
        self.held: dict[int, set[bytes]] = {0: set(), 1: set()}
        self.block_size = 16
        self.attention_groups = [0]
        self.recurrent_groups = [1]
        self.align = 16

    def store(self, group: int, h: bytes) -> None:
        self.held[group].add(h)
        self.events.append(True, group, h)

    def cached_hashes(self) -> dict[int, set[bytes]]:
        return {g: set(h) for g, h in self.held.items()}


def _ctx(cache: _Cache) -> Any:
    core = SimpleNamespace(cache=cache)

    async def acall(fn: Any) -> Any:
        return fn(core)

    return SimpleNamespace(epoch="e1", aengine=SimpleNamespace(core=core, acall=acall))


def test_snapshot_then_batches_then_resync_after_overflow() -> None:
    async def main() -> None:
        cache = _Cache(capacity=4)
        cache.store(0, b"a" * 16)
        hub = CacheEventHub(_ctx(cache), interval_s=0.01)
        s1, s2 = hub.stream(), hub.stream()
        snap = await anext(s1)
        assert snap.snapshot and snap.epoch == "e1" and snap.first_seq == 1
        assert {g.group: set(g.block_hashes) for g in snap.groups} == {0: {b"a" * 16}, 1: set()}
        assert (snap.shape.block_size, list(snap.shape.recurrent_groups), snap.shape.checkpoint_align) == (16, [1], 16)
        assert (await anext(s2)).snapshot
        cache.store(0, b"b" * 16)
        cache.store(1, b"b" * 16)
        for stream in (s1, s2):
            batch = await asyncio.wait_for(anext(stream), 5)
            assert not batch.snapshot and batch.first_seq == 1
            assert [(e.stored, e.group, e.block_hash) for e in batch.events] == [
                (True, 0, b"b" * 16),
                (True, 1, b"b" * 16),
            ]
        for i in range(6):  # more than the log holds between two drains: events are lost
            cache.store(0, bytes([i]) * 16)
        again = await asyncio.wait_for(anext(s1), 5)
        assert again.snapshot and again.first_seq == cache.events.seq == 9
        assert {g.group: len(g.block_hashes) for g in again.groups} == {0: 8, 1: 1}
        await s1.aclose()
        await s2.aclose()

    asyncio.run(main())
