"""Every thread that calls into a worker's NIXL agent gets the agent's CUDA device made current first.

UCX progresses transfers in whichever thread calls it, and where it stages device memory through the host it
copies with CUDA in that thread. kvtransfer/progress.py's thread had never run CUDA: on an H200 both workers of a
PD pair aborted inside UCX ("mem type unpack failed to uct_ep_put_short() Input/output error") on the first 8B
handoff. The binding is checked here on a CPU agent whose device is set by hand, with torch.cuda.set_device
recorded instead of called (no GPU in CI); the GPU PD runs (benchmarks/pd_handoff.py) are the end-to-end check.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvtransfer import AgentConfig, CacheLayout, TransferAgent
from tests.support.kvtransfer_harness import ToyCacheSpec, make_caches

SPEC = ToyCacheSpec(attn_layers=1, num_blocks=8, state_layers=1, num_slots=2)


def test_each_calling_thread_binds_the_agents_cuda_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = make_caches(SPEC, None)
    agent = TransferAgent("bind", CacheLayout.from_tensors(groups, model_id=SPEC.model_id),
                          config=AgentConfig(progress_thread=False))
    try:
        assert agent._cuda_device is None  # a CPU agent binds nothing
        calls: list[tuple[str, int]] = []
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
        synced: list[int] = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d: synced.append(d))
        agent.poll_releases()
        assert calls == []
        agent._cuda_device = 3  # as a VRAM layout on cuda:3 sets it

        def poll_twice() -> None:
            agent.poll_releases()
            agent.poll_releases()

        threads = [threading.Thread(target=poll_twice, name=f"poller-{i}") for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        poll_twice()
        assert sorted(calls) == [("MainThread", 3), ("poller-0", 3), ("poller-1", 3)]
        assert synced == [3, 3, 3]  # a runtime call that binds the primary context in each thread
    finally:
        agent.close()
