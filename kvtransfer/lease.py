"""P side: which finished prompts are pinned for a pull, until when. Tensor-free, NIXL-free.

Ownership: P's engine pins a finished prompt's blocks/slots (its cache manager keeps their ref counts) and records
them here with `grant`. They are unpinned by exactly one of:
  * `release(request_id, epoch)`: D's release notice (NIXL, `TransferAgent.poll_releases`) or gRPC `Release`;
  * `reap(now)`: the lease expired (D died or never came); counted in hybridpd_kv_lease_expired_total.
Both return the `Lease`s whose pages the caller must now free; the table never frees anything itself.
Not thread-safe: call from P's engine thread (the one that owns the cache manager).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import StaleEpochError
from .metrics import TransferMetrics

DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True)
class Lease:
    """Pages pinned for `request_id`: {group id: block or slot ids}. `expires_at` is in the table's clock."""

    request_id: str
    pages_by_group: Mapping[int, tuple[int, ...]]
    granted_at: float
    expires_at: float


class LeaseTable:
    """Leases of one P process (one epoch). `clock` defaults to time.monotonic; inject one in tests."""

    def __init__(
        self,
        epoch: str,
        ttl_s: float = DEFAULT_LEASE_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self.epoch = epoch
        self.ttl_s = ttl_s
        self._clock = clock
        self._metrics = metrics
        self._leases: dict[str, Lease] = {}
        self.expired_total = 0
        self.released_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def check_epoch(self, epoch: str | None) -> None:
        """None or "" means "the current epoch" (gRPC ReleaseRequest default); anything else must match."""
        if epoch and epoch != self.epoch:
            raise StaleEpochError(f"epoch {epoch!r} is not this worker's live epoch {self.epoch!r}")

    def grant(self, request_id: str, pages_by_group: Mapping[int, Sequence[int]], ttl_s: float | None = None) -> Lease:
        """Record pinned pages of a finished prompt. A request id may hold one lease at a time."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        now = self._clock()
        lease = Lease(
            request_id,
            {g: tuple(ids) for g, ids in pages_by_group.items()},
            now,
            now + (self.ttl_s if ttl_s is None else ttl_s),
        )
        self._leases[request_id] = lease
        return lease

    def release(self, request_id: str, epoch: str | None = None) -> Lease | None:
        """End a lease; returns it (the caller frees its pages) or None if unknown / already released or reaped
        (idempotent: a late notice after expiry is fine). Raises StaleEpochError for another epoch's release."""
        self.check_epoch(epoch)
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self.released_total += 1
        return lease

    def reap(self, now: float | None = None) -> list[Lease]:
        """Remove and return expired leases (expires_at <= now), oldest first; call once per engine step."""
        now = self._clock() if now is None else now
        expired = sorted((le for le in self._leases.values() if le.expires_at <= now), key=lambda le: le.expires_at)
        for le in expired:
            del self._leases[le.request_id]
        self.expired_total += len(expired)
        if self._metrics is not None:
            self._metrics.leases_expired(len(expired))
        return expired

    def next_expiry(self) -> float | None:
        return min((le.expires_at for le in self._leases.values()), default=None)

    def check_integrity(self) -> None:
        for rid, le in self._leases.items():
            assert le.request_id == rid, (rid, le)
            assert le.expires_at >= le.granted_at, le
