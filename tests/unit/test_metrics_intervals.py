"""engine/metrics.py: the pool scan (`cache_stats`) is read at most every slow_interval_s while the engine is busy,
once more when it goes idle after steps (a scrape of an idle worker sees its final state), and the engine's step
times are exported by kind."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.metrics import WorkerMetrics
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_pool_scan_is_throttled_while_busy_and_fresh_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = CollectorRegistry()
    metrics = WorkerMetrics("decode", reg, slow_interval_s=3600.0)
    llm = LLM(kv_cache_memory_bytes=8 * 2**20)
    core = llm.engine
    scans: list[int] = []
    real = core.cache.cache_stats

    def counted() -> dict[str, object]:
        scans.append(1)
        return real()

    monkeypatch.setattr(core.cache, "cache_stats", counted)
    metrics.update(core)  # the first update reads everything
    assert len(scans) == 1
    core.add_request("a", [3] * 40, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for _ in range(3):
        core.step()
        metrics.update(core)  # busy: no scan within the slow interval
    assert len(scans) == 1
    steps = reg.get_sample_value("hybridpd_engine_steps_total", {"role": "decode", "kind": "decode"})
    assert steps is not None and steps >= 1  # the cheap figures are current
    while core.has_unfinished():
        core.step()
    metrics.update(core)  # idle after steps: scanned once more
    metrics.update(core)  # ... and not again while nothing stepped
    assert len(scans) == 2
    in_use = reg.get_sample_value(
        "hybridpd_kv_cache_bytes", {"role": "decode", "group": "attention", "state": "in_use"}
    )
    attention = real()["attention"]
    assert isinstance(attention, dict) and in_use == attention["bytes_in_use"]


def test_step_times_are_split_by_kind() -> None:
    llm = LLM(kv_cache_memory_bytes=8 * 2**20)
    llm.generate(
        prompt_token_ids=[[5] * 30, [6] * 20],
        sampling_params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    )
    st = llm.engine.stats
    assert st.steps["prefill"] >= 1 and st.steps["decode"] >= 4
    assert st.step_tokens["prefill"] >= 50 and st.step_tokens["decode"] >= st.steps["decode"]
    assert st.step_seconds["decode"] > 0 and st.steps["decode"] + st.steps["prefill"] == st.num_steps


def test_pages_freed_while_idle_are_scraped_without_another_step() -> None:
    """A prefill worker's pages are let go by an engine call (its lease released, a request aborted) after the
    engine went idle: no step follows, and the in-use bytes must still come back to 0."""
    reg = CollectorRegistry()
    metrics = WorkerMetrics("prefill", reg, slow_interval_s=3600.0)
    core = LLM(kv_cache_memory_bytes=8 * 2**20).engine
    req = core.add_request("p", [3] * 40, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                          prefill_only=True)
    while core.has_unfinished():
        core.step()
    metrics.update(core)  # idle after steps: the pinned pages are in use

    def in_use() -> float | None:
        return reg.get_sample_value("hybridpd_kv_cache_bytes", {"role": "prefill", "group": "attention",
                                                                "state": "in_use"})

    assert (in_use() or 0) > 0
    core.scheduler.release(req)  # the lease ends: an engine call, no step
    metrics.update(core)
    assert in_use() == 0
