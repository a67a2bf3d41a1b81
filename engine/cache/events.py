"""Cache events: what a worker's cache stored and removed, for the router's per-worker cache index.

One event each time an entry becomes findable by a hit search (`stored`) or stops being findable: in attention
group k, a full block named `block_hash`; in recurrent group k, a checkpoint at the end of that block. The router
replays them to guess a prompt's usable hit on the worker (blocks up to the deepest boundary where every recurrent
group holds a checkpoint). Events are advisory: a lost or reordered one only worsens the guess. The log is
bounded: past `capacity` undrained events it keeps none until the next drain, which says `overflowed`; the
consumer then resyncs from `HybridCacheManager.cached_hashes()`.

Ownership: the cache (step thread) appends; the worker's event stream drains. Tensor-free.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEvent:
    stored: bool  # True: the entry became findable; False: it was removed (evicted, freed, quarantined)
    group: int  # cache group id (the same on every worker of one model)
    block_hash: bytes  # attention: the block's chained hash; recurrent: that of the block the checkpoint ends on


class CacheEventLog:
    """A bounded queue of cache events with a running sequence number. One thread appends (the step loop) without
    a lock: each event is one `deque.append`, atomic under the GIL; `drain_from` (any thread) pops what is there.
    The lock only orders a drain against the append that finds the log full and empties it."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._events: deque[tuple[int, bool, int, bytes]] = deque()  # (seq, stored, group, hash): drained as events
        self._capacity = capacity
        self._lock = threading.Lock()
        self.seq = 0
        """Number of events ever appended (monotonic; the consumer's position after a drain)."""
        self.overflowed = False
        """Set when events were dropped since the last drain (then none is kept): the consumer must resync from a
        snapshot."""

    def append(self, stored: bool, group: int, block_hash: bytes) -> None:
        """One event: `block_hash` of `group` became findable (`stored`) or stopped being findable."""
        self.seq = seq = self.seq + 1
        if self.overflowed:
            return
        if len(self._events) < self._capacity:
            self._events.append((seq, stored, group, block_hash))
            return
        with self._lock:
            self._events.clear()
            self.overflowed = True

    def drain_from(self) -> tuple[int, list[CacheEvent], bool]:
        """Take every queued event and clear the overflow mark: (first_seq, events, overflowed), the events numbered
        first_seq + 1, first_seq + 2, ..."""
        with self._lock:
            pop, lost = self._events.popleft, self.overflowed
            raw = [pop() for _ in range(len(self._events))]
            self.overflowed = False
        first = raw[0][0] - 1 if raw else self.seq
        return first, [CacheEvent(*e[1:]) for e in raw], lost
