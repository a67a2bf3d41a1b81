"""P side: which finished prompts are pinned for a pull, until when. Tensor-free, NIXL-free.

Ownership: P's engine pins a finished prompt's blocks/slots (its cache manager keeps their ref counts) and records
them here with `grant`. They are unpinned by exactly one of:
  * `commit(request_id, epoch, token, digest, ...)`: D's READ completed; the answer tells D whether the lease was
    still held (its pages pinned for the whole READ), granted for the same prompt, presented with the params P
    issued unaltered (their MAC, checked by the caller) and whether D read only pages those params offered. D uses
    the data only then.
  * `release(request_id, epoch, token)`: D gave up (NIXL notice, token required) or the proxy's gRPC `Release`;
  * `reap(now)`: the lease expired (D died, froze or never came); counted in hybridpd_kv_lease_expired_total.
Both return the `Lease`s whose pages the caller must now free; the table never frees anything itself.
Thread-safe (one lock): P's Commit RPC decides on the event loop (no step-thread hop on the handover's critical
path) while the reaper runs on the engine thread; whichever ends a lease first wins, and only the winner's caller
frees its pages (on the engine thread, which owns the cache manager).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import StaleEpochError
from .metrics import TransferMetrics

DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True)
class Offer:
    """The pages a lease's transfer params name, by group. Attention groups: block ids in sequence order (D reads a
    suffix: the blocks past its own prefix hit), then, if D takes the offered checkpoint, its pages (read as blocks
    of every attention group). Recurrent groups: (running state slot,); D reads it."""

    blocks: Mapping[int, tuple[int, ...]]
    states: Mapping[int, tuple[int, ...]]
    checkpoint: tuple[int, ...] = ()

    def allows(self, pages_read: Mapping[int, Sequence[int]]) -> bool:
        """Whether `pages_read` (P's ids D read, by group) are exactly such pages: nothing outside the offer, every
        recurrent group's running state read."""
        if not set(pages_read) <= set(self.blocks) | set(self.states):
            return False
        ckpt = self.checkpoint
        took = [ckpt and tuple(pages_read.get(g, ()))[-len(ckpt):] == ckpt for g in self.blocks]
        if len(set(took)) > 1:
            return False  # the checkpoint read in some attention groups only
        for gid, offered in self.blocks.items():
            read = tuple(pages_read.get(gid, ()))
            read = read[: len(read) - len(ckpt)] if took and took[0] else read
            if read != offered[len(offered) - len(read):]:
                return False
        for gid, (running, *_) in self.states.items():
            if tuple(pages_read.get(gid, ())) != (running,):
                return False
        return True


@dataclass(frozen=True)
class Lease:
    """Pages pinned for `request_id`: {group id: block or slot ids}. `expires_at` is in the table's clock."""

    request_id: str
    pages_by_group: Mapping[int, tuple[int, ...]]
    granted_at: float
    expires_at: float
    token: str = ""
    """Random per lease (kvtransfer.binding.new_lease_token): Commit and release notices must present it."""
    prompt_digest: bytes = b""
    """hybridpd.kvtransfer.binding.prompt_digest of the tokens P computed: Commit must present the same."""
    offer: Offer | None = None
    """The pages the transfer params name (None: not checked at Commit)."""


class CommitRefused(Exception):
    """Commit answered "no": `reason` is unknown_lease | stale_epoch | token_mismatch | params_forged |
    prompt_mismatch | pages_mismatch."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _locked(fn):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper


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
        self._lock = threading.Lock()

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

    @_locked
    def grant(self, request_id: str, pages_by_group: Mapping[int, Sequence[int]], ttl_s: float | None = None,
              *, token: str = "", prompt_digest: bytes = b"", offer: Offer | None = None) -> Lease:
        """Record pinned pages of a finished prompt. A request id may hold one lease at a time."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        now = self._clock()
        lease = Lease(
            request_id,
            {g: tuple(ids) for g, ids in pages_by_group.items()},
            now,
            now + (self.ttl_s if ttl_s is None else ttl_s),
            token,
            prompt_digest,
            offer,
        )
        self._leases[request_id] = lease
        return lease

    @_locked
    def release(self, request_id: str, epoch: str | None = None, token: str | None = None) -> Lease | None:
        """End a lease; returns it (the caller frees its pages) or None if unknown / already released or reaped
        (idempotent: a late notice after expiry is fine), or if `token` is not the lease's: callers from outside
        (gRPC Release, NIXL notices) always pass one, so only the holder of the transfer params can end a lease
        early; None is P's own ending of it. Raises StaleEpochError for another epoch's release."""
        self.check_epoch(epoch)
        lease = self._leases.get(request_id)
        if lease is None or (token is not None and lease.token and token != lease.token):
            return None
        del self._leases[request_id]
        return lease

    @_locked
    def commit(self, request_id: str, epoch: str, token: str, prompt_digest: bytes, *, params_authentic: bool = True,
               pages_read: Mapping[int, Sequence[int]] | None = None) -> Lease:
        """D's READ of this lease's pages completed: end the lease and return it (the caller frees its pages) if it
        is still held, was granted under `epoch` and `token`, the params D pulled by are P's own unaltered
        (`params_authentic`: the caller checked their MAC), for a prompt with `prompt_digest`, and D read only
        pages of the lease's offer (`pages_read`, required when the lease has one). Else raise CommitRefused. A
        lease presented with the right token but anything else wrong is ended too (that pull is void)."""
        if epoch != self.epoch:
            raise CommitRefused("stale_epoch")
        lease = self._leases.get(request_id)
        if lease is None:
            raise CommitRefused("unknown_lease")
        if lease.token and token != lease.token:
            raise CommitRefused("token_mismatch")  # not ended: the caller does not own this lease
        del self._leases[request_id]
        if not params_authentic:
            raise CommitRefused("params_forged")
        if lease.prompt_digest != prompt_digest:
            raise CommitRefused("prompt_mismatch")
        if lease.offer is not None and (pages_read is None or not lease.offer.allows(pages_read)):
            raise CommitRefused("pages_mismatch")
        return lease

    @_locked
    def reap(self, now: float | None = None) -> list[Lease]:
        """Remove and return expired leases (expires_at <= now), oldest first; call once per engine step."""
        now = self._clock() if now is None else now
        expired = sorted((le for le in self._leases.values() if le.expires_at <= now), key=lambda le: le.expires_at)
        for le in expired:
            del self._leases[le.request_id]
        if self._metrics is not None:
            self._metrics.leases_expired(len(expired))
        return expired

    @_locked
    def check_integrity(self) -> None:
        for rid, le in self._leases.items():
            assert le.request_id == rid, (rid, le)
            assert le.expires_at >= le.granted_at, le
