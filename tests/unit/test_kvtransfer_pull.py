"""kvtransfer pull state machine against a scripted fake agent: timeout (injected clock), NIXL errors, cancel,
empty pulls, release notices and metrics. The real NIXL path is in tests/integration/test_kvtransfer.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hybridpd.kvtransfer import CacheLayout, PullSpec, PullState, Region, StaleEpochError, TransferMetrics, start_pull
from hybridpd.kvtransfer.notify import decode_release
from prometheus_client import CollectorRegistry


def layout(base: int) -> CacheLayout:
    regions = (Region("g0.l0.kv", 0, 0, base, 1024, 1024, 16), Region("g1.l1.ssm", 1, 1, base + 0x10000, 64, 64, 4))
    return CacheLayout(regions, {0: "attention", 1: "mamba2"}, {"model_id": "m"})


@dataclass
class FakeAgent:
    statuses: list[str]  # what post() and then each check() report
    layout: CacheLayout = field(default_factory=lambda: layout(0x9000000))
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    release_ok: bool = True
    notifs: list[bytes] = field(default_factory=list)
    made: list[bytes] = field(default_factory=list)
    parallel_reads: int = 1
    notice_after_done: bool = False
    plans: list[Any] = field(default_factory=list)
    released: int = 0

    def __post_init__(self) -> None:
        self.metrics = TransferMetrics("decode", self.registry)

    def make_read(self, peer: Any, plan: Any, notif: bytes) -> object:
        self.made.append(notif)
        self.plans.append(plan)
        return object()

    def post(self, handle: object) -> str:
        return self.statuses.pop(0)

    def check(self, handle: object) -> str:
        status = self.statuses.pop(0)
        if status == "RAISE":
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return status

    def release_xfer(self, handle: object) -> bool:
        self.released += 1
        return self.release_ok

    def xfer_telemetry(self, handle: object) -> None:
        return None

    def send_notif(self, peer: Any, msg: bytes) -> bool:
        self.notifs.append(msg)
        return True

    def failures(self, reason: str) -> float:
        return (
            self.registry.get_sample_value("hybridpd_kv_transfer_failures_total", {"role": "decode", "reason": reason})
            or 0.0
        )


@dataclass
class FakePeer:
    agent: FakeAgent
    worker: str = "P0"
    epoch: str = "e1"
    valid: bool = True
    layout: CacheLayout = field(default_factory=lambda: layout(0x1000000))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


SPEC = PullSpec("r1", "e1", {0: [1, 2, 5]}, {0: [3, 4, 9]}, {1: [2]}, {1: [1]})


def test_done_notifies_p_through_the_transfer_and_records_metrics() -> None:
    agent = FakeAgent(["PROC", "PROC", "DONE"])
    h = start_pull(FakePeer(agent), SPEC)  # type: ignore[arg-type]
    assert [h.poll(), h.poll()] == [PullState.PENDING, PullState.DONE]
    assert h.poll() is PullState.DONE  # stays done, no more checks
    assert h.result is not None and (h.result.nbytes, h.result.descriptors) == (3 * 1024 + 64, 2 + 1)
    assert [decode_release(m) for m in agent.made] == [("r1", "e1", True, "")] and agent.notifs == []
    assert (
        agent.registry.get_sample_value("hybridpd_kv_transfer_bytes_total", {"role": "decode", "group": "attention"})
        == 3 * 1024
    )


def test_timeout_fails_with_policy_and_releases_p() -> None:
    agent, clock = FakeAgent(["PROC"] * 10), Clock()
    h = start_pull(FakePeer(agent), SPEC, timeout_s=5.0, policy="fail", clock=clock)  # type: ignore[arg-type]
    clock.t = 4.9
    assert h.poll() is PullState.PENDING
    clock.t = 5.0
    assert h.poll() is PullState.FAILED
    assert h.result is not None and (h.result.reason, h.result.policy, h.result.nbytes) == ("timeout", "fail", 0)
    assert [decode_release(m) for m in agent.notifs] == [("r1", "e1", False, "")]
    assert agent.failures("timeout") == 1


@pytest.mark.parametrize("statuses", [["ERR"], ["PROC", "ERR"], ["PROC", "RAISE"]])
def test_nixl_errors_fail_the_pull(statuses: list[str]) -> None:
    agent = FakeAgent(statuses)
    h = start_pull(FakePeer(agent), SPEC)  # type: ignore[arg-type]
    res = h.wait(interval_s=0)
    assert (res.state, res.reason, res.policy) == (PullState.FAILED, "nixl_error", "recompute")
    assert agent.failures("nixl_error") == 1


def test_cancel_reports_uncancellable_reads() -> None:
    agent = FakeAgent(["PROC", "PROC"], release_ok=False)
    h = start_pull(FakePeer(agent), SPEC)  # type: ignore[arg-type]
    h.cancel()
    assert h.result is not None and (h.result.reason, h.result.dst_reusable) == ("cancelled", False)
    h.cancel()  # no-op once finished
    assert agent.failures("cancelled") == 1


def test_nothing_to_pull_still_releases_p() -> None:
    agent = FakeAgent([])
    h = start_pull(FakePeer(agent), PullSpec("r2", "e1"))  # type: ignore[arg-type]
    assert h.poll() is PullState.DONE and agent.made == []
    assert [decode_release(m) for m in agent.notifs] == [("r2", "e1", True, "")]


def test_stale_epoch_and_replaced_peer_are_refused() -> None:
    agent = FakeAgent([])
    with pytest.raises(StaleEpochError, match="'old'"):
        start_pull(FakePeer(agent), PullSpec("r3", "old"))  # type: ignore[arg-type]
    with pytest.raises(StaleEpochError, match="replaced"):
        start_pull(FakePeer(agent, valid=False), PullSpec("r3", "e1"))  # type: ignore[arg-type]
    assert agent.failures("stale_epoch") == 2 and agent.made == []


def test_parallel_reads_split_the_bytes_and_notify_once_all_are_done() -> None:
    # three posts (PROC, DONE, PROC); each poll checks only the READs still pending: (PROC, DONE), then (DONE)
    agent = FakeAgent(["PROC", "DONE", "PROC", "PROC", "DONE", "DONE"], parallel_reads=3)
    h = start_pull(FakePeer(agent), SPEC)  # type: ignore[arg-type]
    assert len(agent.plans) == 3 and agent.made == [b"", b"", b""]  # no READ carries the notice
    assert sum(p.nbytes for p in agent.plans) == 3 * 1024 + 64
    assert h.poll() is PullState.PENDING and agent.notifs == []  # one READ still in flight: P not released yet
    assert h.poll() is PullState.DONE and agent.statuses == []
    assert [decode_release(m) for m in agent.notifs] == [("r1", "e1", True, "")]
    assert agent.released == 3
    assert h.result is not None and (h.result.nbytes, h.result.descriptors) == (3 * 1024 + 64, 3)


def test_one_failed_read_of_several_fails_the_pull_and_releases_all() -> None:
    agent = FakeAgent(["PROC", "PROC", "PROC", "DONE", "ERR", "PROC"], parallel_reads=3)
    h = start_pull(FakePeer(agent), SPEC, policy="fail")  # type: ignore[arg-type]
    assert h.poll() is PullState.FAILED
    assert h.result is not None and (h.result.reason, h.result.nbytes) == ("nixl_error", 0)
    assert [decode_release(m) for m in agent.notifs] == [("r1", "e1", False, "")]  # never an ok=1 notice
    assert agent.released == 3


def test_notice_after_done_keeps_the_notice_off_the_read() -> None:
    agent = FakeAgent(["PROC", "DONE"], notice_after_done=True)
    h = start_pull(FakePeer(agent), SPEC)  # type: ignore[arg-type]
    assert agent.made == [b""] and agent.notifs == []
    assert h.poll() is PullState.DONE
    assert [decode_release(m) for m in agent.notifs] == [("r1", "e1", True, "")]


@pytest.mark.parametrize("kwargs", [{"parallel_reads": 0}, {"num_workers": -1}])
def test_agent_config_refuses_nonsense(kwargs: dict[str, int]) -> None:
    from hybridpd.kvtransfer import AgentConfig

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        AgentConfig(**kwargs)  # type: ignore[arg-type]


def test_without_notify_done_a_pull_sends_no_ok_notice_and_failure_notices_carry_the_lease_token() -> None:
    from dataclasses import replace

    agent = FakeAgent(["DONE"])
    h = start_pull(FakePeer(agent), replace(SPEC, notify_done=False, lease_token="tok"))  # type: ignore[arg-type]
    assert h.poll() is PullState.DONE
    assert agent.made == [b""] and agent.notifs == []  # D ends the lease with Commit instead
    agent = FakeAgent(["PROC", "ERR"])
    h = start_pull(FakePeer(agent), replace(SPEC, notify_done=False, lease_token="tok"))  # type: ignore[arg-type]
    assert h.poll() is PullState.FAILED
    assert [decode_release(m) for m in agent.notifs] == [("r1", "e1", False, "tok")]
