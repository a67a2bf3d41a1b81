"""engine/metrics.py: WorkerMetrics exports the prefix cache's counters from a real (tiny) engine: hits by group,
bytes held per kind and state, evictions and admitted checkpoints ("bytes held by kind"), on a private
registry."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.metrics import WorkerMetrics
from prometheus_client import CollectorRegistry

from tests.oracle import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cache_counters_and_bytes_are_exported(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    reg = CollectorRegistry()
    metrics = WorkerMetrics("decode", reg)
    llm = LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=8 * 2**20)
    core = llm.engine
    metrics.update(core)

    def value(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, {"role": "decode", **labels}) or 0.0

    assert reg.get_sample_value("hybridpd_prefix_cache_checkpoints_admitted_total", {"role": "decode"}) == 0.0
    assert reg.get_sample_value("hybridpd_prefix_cache_evictions_total", {"role": "decode", "group": "mamba2"}) == 0
    prompt = random_prompts([100], vocab=256, seed=4)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)  # the second one hits
    metrics.update(core)
    kinds = {g.kind for g in core.groups}
    assert kinds == {"attention", "mamba2"}
    assert value("hybridpd_prefix_cache_hits_total", group="attention") > 0
    assert value("hybridpd_prefix_cache_checkpoints_admitted_total") >= 1
    stats = core.cache.cache_stats()
    for kind in kinds:
        assert value("hybridpd_kv_cache_bytes", group=kind, state="cached") == stats[kind]["bytes_cached"] > 0
        assert value("hybridpd_kv_cache_bytes", group=kind, state="in_use") == stats[kind]["bytes_in_use"] == 0
