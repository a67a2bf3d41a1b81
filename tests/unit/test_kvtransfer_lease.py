"""kvtransfer lease table (P side): grant, release, reap with an injected clock; epoch checks; metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvtransfer import LeaseTable, StaleEpochError, TransferMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def table(ttl: float = 30.0) -> tuple[LeaseTable, Clock, CollectorRegistry]:
    clock, reg = Clock(), CollectorRegistry()
    return LeaseTable("e1", ttl, clock=clock, metrics=TransferMetrics("prefill", reg)), clock, reg


def expired_metric(reg: CollectorRegistry) -> float | None:
    return reg.get_sample_value("hybridpd_kv_lease_expired_total", {"role": "prefill"})


def test_grant_then_release_returns_the_pages_once() -> None:
    t, clock, _ = table()
    lease = t.grant("r1", {0: [4, 5, 6], 1: [2]})
    assert lease.expires_at == 1030.0 and lease.pages_by_group == {0: (4, 5, 6), 1: (2,)}
    assert "r1" in t and len(t) == 1
    assert t.release("r1", "e1") == lease
    assert t.release("r1", "e1") is None  # idempotent
    assert len(t) == 0 and t.released_total == 1
    t.check_integrity()


def test_reaper_frees_expired_leases_oldest_first_and_counts_them() -> None:
    t, clock, reg = table()
    t.grant("a", {0: [1]})
    clock.t += 10
    t.grant("b", {0: [2]}, ttl_s=5)  # expires at 1015, before "a" (1030)
    t.grant("c", {0: [3]})  # 1040
    assert t.next_expiry() == 1015.0
    assert t.reap(1014.9) == []
    assert [le.request_id for le in t.reap(1030.0)] == ["b", "a"]
    assert t.expired_total == 2 and expired_metric(reg) == 2.0
    clock.t = 2000.0
    assert [le.request_id for le in t.reap()] == ["c"]
    assert expired_metric(reg) == 3.0 and len(t) == 0
    assert t.release("c") is None  # a late release after expiry is harmless
    t.check_integrity()


def test_stale_epoch_is_refused() -> None:
    t, _, _ = table()
    t.grant("r1", {0: [1]})
    with pytest.raises(StaleEpochError, match="'old'"):
        t.release("r1", "old")
    assert "r1" in t
    t.check_epoch(None)
    t.check_epoch("")  # gRPC ReleaseRequest default: the current epoch
    assert t.release("r1", "") is not None


def test_one_lease_per_request() -> None:
    t, _, _ = table()
    t.grant("r1", {0: [1]})
    with pytest.raises(ValueError, match="already holds"):
        t.grant("r1", {0: [2]})


def test_metrics_families_are_shared_per_registry() -> None:
    reg = CollectorRegistry()
    a, b = TransferMetrics("decode", reg), TransferMetrics("prefill", reg)
    a.transfer_done({"attention": 100, "mamba2": 7}, 0.01, 12)
    b.transfer_failed("timeout")
    assert reg.get_sample_value("hybridpd_kv_transfer_bytes_total", {"role": "decode", "group": "attention"}) == 100
    assert reg.get_sample_value("hybridpd_kv_transfer_descriptors_sum", {"role": "decode"}) == 12
    assert reg.get_sample_value("hybridpd_kv_transfer_seconds_count", {"role": "decode"}) == 1
    assert reg.get_sample_value("hybridpd_kv_transfer_failures_total", {"role": "prefill", "reason": "timeout"}) == 1
