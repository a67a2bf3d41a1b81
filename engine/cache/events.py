"""Cache events: what a worker's cache stored and removed, for the router's per-worker cache index.

A worker's cache emits one event each time a cached entry becomes findable by a prefix-hit search (`stored`) or
stops being findable (`removed`):

- attention group k: a full block whose chained hash is `block_hash` is in group k's hash map (a later request with
  the same prefix would hit it);
- recurrent group k: a checkpoint (saved state) at the boundary of the block whose hash is `block_hash` is cached
  in group k.

The router (proxy side) replays a worker's events into its index and computes a prompt's *usable hit* on that
worker: attention blocks up to the deepest block boundary where every recurrent group holds a checkpoint (what the
worker's own hit search would return). Events are advisory: a lost, duplicated or reordered event only makes the
router's guess worse; the worker always computes its real hit itself. `CacheEventLog` is bounded: when a consumer
falls behind by more than `capacity` events the log drops the oldest ones and marks itself `overflowed`; the
consumer then resyncs from a snapshot (`HybridCacheManager.cached_hashes()`).

Ownership: the cache (step thread) appends; the worker's event stream drains. Tensor-free.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEvent:
    stored: bool
    """True: the entry became findable; False: it was removed (evicted, freed, quarantined)."""
    group: int
    """Cache group index, in the coordinator's group order (the same on every worker of one model)."""
    block_hash: bytes
    """Attention: the block's chained hash. Recurrent: the hash of the block the checkpoint ends on."""


class CacheEventLog:
    """A bounded, thread-safe queue of cache events with a running sequence number."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._events: deque[tuple[bool, int, bytes]] = deque()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.seq = 0
        """Number of events ever appended (monotonic; the consumer's position after a drain)."""
        self.overflowed = False
        """Set when events were dropped since the last drain: the consumer must resync from a snapshot."""

    def stored(self, group: int, block_hash: bytes) -> None:
        self._append(True, group, block_hash)

    def removed(self, group: int, block_hash: bytes) -> None:
        self._append(False, group, block_hash)

    def _append(self, stored: bool, group: int, block_hash: bytes) -> None:
        with self._lock:  # a plain tuple here: the CacheEvent is built when drained (off the step loop's path)
            if len(self._events) >= self._capacity:
                self._events.popleft()
                self.overflowed = True
            self._events.append((stored, group, block_hash))
            self.seq += 1

    def drain(self) -> tuple[list[CacheEvent], bool]:
        """Take every queued event; returns (events, overflowed) and clears the overflow mark."""
        _, events, lost = self.drain_from()
        return events, lost

    def drain_from(self) -> tuple[int, list[CacheEvent], bool]:
        """`drain` with the sequence number just before the first returned event: (first_seq, events, overflowed);
        the events are numbered first_seq + 1, first_seq + 2, ..."""
        with self._lock:
            raw, lost = list(self._events), self.overflowed
            self._events.clear()
            self.overflowed = False
            first = self.seq - len(raw)
        return first, [CacheEvent(*e) for e in raw], lost
