"""What progresses each rank's NIXL agent in tensor-parallel PD (kvtransfer/tp_pull.py `start_rank_agent`).

A follower rank's agent is touched only by rank 0's commands. With GPU caches no light progress thread is allowed
(kvtransfer.progress.interval_from_env), so a P follower, whose agent must answer D's connection setup and READs,
was progressed by nothing: on two H100s every pull from a TP 2 P timed out while CPU runs passed. These tests pin
the configuration per rank, role and device without a GPU: P followers on VRAM run NIXL's own progress thread,
D followers on VRAM advance their READs from their command loop (check_rank_pull), DRAM followers keep the light
thread, and rank 0 (the TP 1 path) is left exactly as configured."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hybridpd.kvtransfer import tp_pull
from hybridpd.kvtransfer.agent import AgentConfig


@dataclass
class _FakeAgent:
    name: str
    layout: Any
    epoch: str
    config: AgentConfig
    checks: list[object] = field(default_factory=list)

    def local_metadata(self) -> bytes:
        return self.name.encode()

    def poll_releases(self) -> list[object]:
        return []

    def check(self, xfer: object) -> str:
        self.checks.append(xfer)
        return "DONE"


def _start(monkeypatch: pytest.MonkeyPatch, rank: int, role: str, device: str, config: AgentConfig) -> Any:
    """start_rank_agent on `rank` with fake caches and agent; returns this process's rank state."""
    from hybridpd.engine.parallel import handoff
    from hybridpd.kvtransfer import agent as agent_mod
    from hybridpd.kvtransfer import metrics

    monkeypatch.delenv("HYBRIDPD_TRANSFER_PROGRESS_S", raising=False)
    monkeypatch.setattr(tp_pull, "_RANK", None)
    monkeypatch.setattr(tp_pull, "rank_layout", lambda *a: SimpleNamespace(device_type=device))
    monkeypatch.setattr(handoff, "sharded_tensors", lambda *a: {})
    monkeypatch.setattr(metrics, "TransferMetrics", lambda role: None)
    monkeypatch.setattr(
        agent_mod, "TransferAgent", lambda name, layout, epoch, config, metrics: _FakeAgent(name, layout, epoch, config)
    )
    setup = {"groups": [], "model_id": "m", "checkpoint_interval": 32, "name": f"{role}-w", "epoch": "e1"}
    setup.update(agent_config=config, role=role, world=2)
    blob = tp_pull.start_rank_agent(SimpleNamespace(group_tensors={}, model=None), rank, setup)
    assert blob == (f"{role}-w" if rank == 0 else f"{role}-w.r{rank}").encode(), blob
    st = tp_pull._RANK
    assert st is not None
    return st


def test_p_follower_on_gpu_runs_nixl_progress_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    st = _start(monkeypatch, 1, "prefill", "cuda", AgentConfig(progress_thread=False))
    assert st.agent.config.progress_thread is True  # answers D's READs with nothing else progressing it
    assert st.progress is None  # no Python thread calls NIXL on a GPU agent


def test_d_follower_on_gpu_advances_reads_from_its_command_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    st = _start(monkeypatch, 1, "decode", "cuda", AgentConfig(progress_thread=False))
    assert st.agent.config.progress_thread is False and st.progress is None  # NIXL's thread on a GPU D: UCX abort
    st.pulls["r#1"] = ["read-from-p0", "read-from-p1"]
    assert tp_pull.check_rank_pull(None, 1, "r#1") == "DONE"
    assert st.agent.checks == ["read-from-p0", "read-from-p1"]  # each of rank 0's polls progresses every READ


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_rank0_on_gpu_is_left_as_configured(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    st = _start(monkeypatch, 0, role, "cuda", AgentConfig(progress_thread=False))
    assert st.agent.config.progress_thread is False and st.progress is None  # its services progress it (TP 1)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_follower_on_cpu_keeps_the_light_thread(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    st = _start(monkeypatch, 1, role, "cpu", AgentConfig(progress_thread=False))
    try:
        assert st.agent.config.progress_thread is False
        assert st.progress is not None and st.progress.interval_s == pytest.approx(1e-3)
    finally:
        if st.progress is not None:
            st.progress.stop()


def test_explicit_nixl_thread_is_kept_and_no_light_thread_is_added() -> None:
    on = AgentConfig(progress_thread=True)
    for rank, role, interval in ((1, "prefill", None), (1, "decode", 2e-4), (0, "prefill", 2e-4)):
        assert tp_pull.rank_progress(rank, role, "cuda", on, interval) == (on, None)
