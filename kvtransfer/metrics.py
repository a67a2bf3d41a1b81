"""Prometheus metrics of the transfer layer (the names are a contract; dashboards rely on them).

    hybridpd_kv_transfer_bytes_total{role, group}      bytes pulled (group = cache group kind)
    hybridpd_kv_transfer_seconds{role}                 histogram: pull start -> data in place
    hybridpd_kv_transfer_descriptors{role}             histogram: descriptors per pull (coalesced runs x regions)
    hybridpd_kv_transfer_failures_total{role, reason}  reason: timeout | nixl_error | stale_epoch | ...
    hybridpd_kv_lease_expired_total{role}              leases freed by the reaper (consumer never released)
    hybridpd_kv_admission_refused_total{role}          prefills refused: too many pages pinned for transfers
    hybridpd_kv_transfer_commit_seconds{role}          histogram: D's READ done -> P's Commit answer
    hybridpd_kv_handoff_seconds{role, phase}           histogram: one PD handoff cut into phases (HANDOFF_PHASES)

Families are created once per registry (a second `TransferMetrics` on the same registry reuses them), so tests pass
their own `CollectorRegistry` and workers use the default global one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)


@dataclass(frozen=True)
class _Families:
    bytes_total: Counter
    seconds: Histogram
    descriptors: Histogram
    failures: Counter
    lease_expired: Counter
    admission_refused: Counter
    commit_seconds: Histogram
    handoff_seconds: Histogram


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _families_for(registry: CollectorRegistry) -> _Families:
    with _lock:
        fam = _families.get(registry)
        if fam is None:
            fam = _Families(
                Counter(
                    "hybridpd_kv_transfer_bytes",
                    "KV/state bytes pulled over NIXL",
                    ["role", "group"],
                    registry=registry,
                ),
                Histogram(
                    "hybridpd_kv_transfer_seconds",
                    "Pull start to data in place",
                    ["role"],
                    buckets=SECONDS_BUCKETS,
                    registry=registry,
                ),
                Histogram(
                    "hybridpd_kv_transfer_descriptors",
                    "NIXL descriptors per pull",
                    ["role"],
                    buckets=DESCRIPTOR_BUCKETS,
                    registry=registry,
                ),
                Counter(
                    "hybridpd_kv_transfer_failures", "Failed pulls by reason", ["role", "reason"], registry=registry
                ),
                Counter("hybridpd_kv_lease_expired", "Leases freed by the reaper", ["role"], registry=registry),
                Counter(
                    "hybridpd_kv_admission_refused",
                    "Prefills refused because too many pages are pinned for transfers (RESOURCE_EXHAUSTED)",
                    ["role"],
                    registry=registry,
                ),
                Histogram(
                    "hybridpd_kv_transfer_commit_seconds",
                    "READ done -> P's Commit answer on D (the fail-closed confirmation's share of the handover)",
                    ["role"],
                    buckets=SECONDS_BUCKETS,
                    registry=registry,
                ),
                Histogram(
                    "hybridpd_kv_handoff_seconds",
                    "One prefill->decode handoff by phase (TransferMetrics.HANDOFF_PHASES)",
                    ["role", "phase"],
                    buckets=SECONDS_BUCKETS,
                    registry=registry,
                ),
            )
            _families[registry] = fam
        return fam


class TransferMetrics:
    """Metric handles bound to one worker role ("prefill" | "decode"). Thread-safe (prometheus_client is)."""

    FAILURE_REASONS = ("timeout", "nixl_error", "stale_epoch", "cancelled")
    """Pull failures (D), and D's refusals before pulling. Fail-closed outcomes, each counted and each
    ending in a recompute or an error, never in pulled data being used:
      D: lease_expired (no time left on the lease to pull), prompt_mismatch (params are not this prompt's),
         unknown_peer (not a prefill worker of this cluster), lease_lost (P's Commit said no);
      P: commit_unknown_lease | commit_stale_epoch | commit_token_mismatch | commit_prompt_mismatch."""
    FAIL_CLOSED_REASONS = {
        "decode": ("lease_expired", "prompt_mismatch", "unknown_peer", "lease_lost"),
        "prefill": ("commit_unknown_lease", "commit_stale_epoch", "commit_token_mismatch", "commit_prompt_mismatch"),
    }

    HANDOFF_PHASES = {
        "prefill": ("queue", "prefill", "lease"),
        "decode": ("handshake", "admit", "pull", "commit", "resume", "total"),
    }
    """hybridpd_kv_handoff_seconds phases. P: queue (Prefill RPC received -> request added by the step thread),
    prefill (added -> prefilled and leased), lease (leased -> Commit or release ended the lease: P's pages stay
    pinned this long). D: handshake (Generate received -> peer known), admit (-> pull posted by the step thread),
    pull (posted -> a poll saw the READ done), commit (-> P's Commit answered), resume (-> the first token reached
    the Generate stream), total (Generate received -> first token)."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self._f = _families_for(registry if registry is not None else REGISTRY)
        # Export event counters at 0 from the start, so dashboards show 0 rather than "no data".
        for reason in self.FAILURE_REASONS + self.FAIL_CLOSED_REASONS.get(role, ()):
            self._f.failures.labels(role, reason)
        self._f.lease_expired.labels(role)
        if role == "prefill":
            self._f.admission_refused.labels(role)
        # children bound once: labels() looks the child up on every call, and transfer_done runs on the handover path
        self._seconds = self._f.seconds.labels(role)
        self._descriptors = self._f.descriptors.labels(role)
        self._bytes: dict[str, Counter] = {}
        self._handoff: dict[str, Histogram] = {}

    def transfer_done(self, bytes_by_kind: Mapping[str, int], seconds: float, descriptors: int) -> None:
        for kind, n in bytes_by_kind.items():
            child = self._bytes.get(kind)
            if child is None:
                child = self._bytes[kind] = self._f.bytes_total.labels(self.role, kind)
            child.inc(n)
        self._seconds.observe(seconds)
        self._descriptors.observe(descriptors)

    def transfer_failed(self, reason: str) -> None:
        self._f.failures.labels(self.role, reason).inc()

    def commit_seconds(self, seconds: float) -> None:
        self._f.commit_seconds.labels(self.role).observe(seconds)

    def handoff(self, phase: str, seconds: float) -> None:
        child = self._handoff.get(phase)
        if child is None:
            child = self._handoff[phase] = self._f.handoff_seconds.labels(self.role, phase)
        child.observe(max(0.0, seconds))

    def admission_refused(self) -> None:
        self._f.admission_refused.labels(self.role).inc()

    def leases_expired(self, n: int) -> None:
        if n:
            self._f.lease_expired.labels(self.role).inc(n)
