"""Leases on prefilled requests' caches (producer side). Tensor-free.

A finished prefill keeps its attention blocks, its running state slot and (if any) the checkpoint slot it hands
out pinned until the consumer releases them (NIXL notification or gRPC Release) or the lease expires (the reaper
frees it and counts it). Step thread only."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.request import Request


@dataclass
class Lease:
    request: Request
    expiry: float
    checkpoint_slot: int | None
    checkpoint_tokens: int


class LeaseTable:
    def __init__(self, free: Callable[[Lease], None], ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._free = free
        self.ttl_s = ttl_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.num_expired = 0
        self.num_released = 0

    def pin(self, req: Request, checkpoint_slot: int | None, checkpoint_tokens: int) -> Lease:
        lease = Lease(req, self.clock() + self.ttl_s, checkpoint_slot, checkpoint_tokens)
        self.leases[req.request_id] = lease
        return lease

    def release(self, request_id: str) -> bool:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self._free(lease)
        self.num_released += 1
        return True

    def reap(self) -> list[str]:
        now = self.clock()
        expired = [rid for rid, lease in self.leases.items() if lease.expiry <= now]
        for rid in expired:
            self._free(self.leases.pop(rid))
            self.num_expired += 1
        return expired

    def __len__(self) -> int:
        return len(self.leases)
