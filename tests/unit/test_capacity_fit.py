"""The engine sizes its running batch from the cache budget it has, and a model that cannot fit fails at start-up
with the numbers."""

from __future__ import annotations

import re

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.core import fit_running_seqs
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.memory_fit import fmt_bytes, largest_fitting, smallest_fitting


def test_fit_finds_the_largest_batch_that_leaves_room() -> None:
    fits = {n: (n <= 37) for n in range(1, 65)}
    got = fit_running_seqs(lambda n: n if fits[n] else None, 64)  # type: ignore[arg-type, return-value]
    assert got == 37
    assert fit_running_seqs(lambda n: n, 64) == 64  # type: ignore[arg-type, return-value]
    assert fit_running_seqs(lambda n: None, 64) is None


def test_small_budget_lowers_max_num_seqs_and_still_serves_max_model_len() -> None:
    llm = LLM(kv_cache_memory_bytes=2**20, max_model_len=512, max_num_seqs=64)
    plan, n = llm.engine.plan, llm.engine.config.scheduler.max_num_seqs
    assert 1 <= n < 64 and plan.state_slots_running == n and plan.token_capacity >= 512
    assert llm.engine.scheduler.config.max_num_seqs == n
    out = llm.generate(prompt_token_ids=[[7] * 500] * 3, sampling_params=SamplingParams(max_tokens=4, temperature=0))
    assert [len(o.token_ids) for o in out] == [4, 4, 4]


def test_a_model_that_cannot_fit_fails_with_the_numbers() -> None:
    # one running request reserves 4 state slots (null, running, 2 staging) of 6 pages: 96 KiB; 128 KiB leaves 8
    # pages (7 usable blocks)
    with pytest.raises(InvalidRequestError) as e:
        LLM(kv_cache_memory_bytes=128 * 1024, max_model_len=4096)
    msg = str(e.value)
    assert re.search(
        r"does not fit: one request of max_model_len=4096 tokens needs [0-9.]+ MiB of cache \([0-9.]+ KiB of "
        r"recurrent state \+ \d+ B/token of attention KV\), the cache budget is 128.0 KiB: max concurrency at "
        r"max_model_len=4096 is 0 and the largest max_model_len it holds is (\d+) tokens\. To serve it: raise "
        r"--kv-cache-memory-bytes",
        msg,
    ), msg
    largest = int(re.search(r"it holds is (\d+) tokens", msg).group(1))  # type: ignore[union-attr]
    assert largest == 7 * 16
    assert LLM(kv_cache_memory_bytes=128 * 1024, max_model_len=largest).engine.plan.max_concurrency >= 1  # it does
    with pytest.raises(InvalidRequestError, match=f"max_model_len={largest + 1} tokens"):
        LLM(kv_cache_memory_bytes=128 * 1024, max_model_len=largest + 1)  # and no more


def test_a_budget_below_the_state_slots_of_one_request_holds_no_request() -> None:
    with pytest.raises(InvalidRequestError, match="the cache budget is 64.0 KiB: max concurrency at max_model_len=4096 "
                       "is 0 and it holds no request at all"):
        LLM(kv_cache_memory_bytes=64 * 1024, max_model_len=4096)  # less than the 96 KiB of 4 state slots


def test_search_helpers() -> None:
    assert largest_fitting(lambda n: n <= 37, 100) == 37 and largest_fitting(lambda n: False, 100) == 0
    assert largest_fitting(lambda n: True, 100) == 100
    assert smallest_fitting(lambda b: b >= 4097, 1 << 50) == 4097 and smallest_fitting(lambda b: True, 9) == 1
    assert [fmt_bytes(x) for x in (512, 20992, 3 * 2**20, 63.5 * 2**30)] == ["512 B", "20.5 KiB", "3.0 MiB", "63.5 GiB"]


GiB = 2**30


@pytest.fixture(scope="module")
def tiny_engine():  # type: ignore[no-untyped-def]
    return LLM(kv_cache_memory_bytes=4 * 2**20, max_model_len=4096).engine


def _on_a_gpu(monkeypatch: pytest.MonkeyPatch, engine, total: int, free: int, weights: int, utilization: float):  # type: ignore[no-untyped-def]
    """The engine's planner as it would run on a CUDA device with this memory (torch.cuda's answers faked)."""
    import dataclasses

    monkeypatch.setattr(engine, "device", torch.device("cuda", 0))
    monkeypatch.setattr(engine, "_gpu", None)
    cache = dataclasses.replace(engine.config.cache, kv_cache_memory_bytes=None, gpu_memory_utilization=utilization)
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, cache=cache))
    for name, value in (("synchronize", None), ("empty_cache", None), ("memory_reserved", 0)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: weights)
    return engine


def test_on_a_gpu_the_cache_gets_the_share_left_after_weights(monkeypatch: pytest.MonkeyPatch, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    engine = _on_a_gpu(monkeypatch, tiny_engine, total=80 * GiB, free=79 * GiB, weights=63 * GiB, utilization=0.9)
    plan = engine._plan({})
    assert engine._gpu.share == int(0.9 * 80 * GiB) and engine._gpu.weights == 63 * GiB
    assert plan.kv_cache_memory_bytes == engine._gpu.cache > 8 * GiB  # 72 - 63 - the activation reserve
    assert plan.max_concurrency >= 1 and f"max concurrency at max_model_len=4096: {plan.max_concurrency}" in (
        plan.log_line()
    )


def test_on_a_gpu_weights_that_leave_no_cache_fail_with_the_numbers(
    monkeypatch: pytest.MonkeyPatch, tiny_engine
) -> None:  # type: ignore[no-untyped-def]
    engine = _on_a_gpu(monkeypatch, tiny_engine, total=80 * GiB, free=79 * GiB, weights=75 * GiB, utilization=0.9)
    with pytest.raises(InvalidRequestError) as e:
        engine._plan({})
    msg = str(e.value)
    for part in (
        "one request of max_model_len=4096 tokens needs",
        "B/token of attention KV), the cache budget is 0 B",
        "of the 72.0 GiB share of the GPU (gpu_memory_utilization 0.9 of 80.0 GiB), weights take 75.0 GiB",
        "max concurrency at max_model_len=4096 is 0 and it holds no request at all",
        "raise --gpu-memory-utilization",
    ):
        assert part in msg, msg


def test_on_a_gpu_a_share_that_is_not_free_is_refused(monkeypatch: pytest.MonkeyPatch, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    engine = _on_a_gpu(monkeypatch, tiny_engine, total=80 * GiB, free=40 * GiB, weights=0, utilization=0.9)
    with pytest.raises(
        InvalidRequestError, match=r"asks for 72.0 GiB of the GPU's 80.0 GiB, but only 40.0 GiB is free"
    ):
        engine._plan({})


def test_on_a_gpu_a_kv_cache_memory_bytes_past_the_free_memory_is_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_engine
) -> None:  # type: ignore[no-untyped-def]
    """--kv-cache-memory-bytes (vLLM's: the cache size, gpu_memory_utilization ignored) larger than the GPU's free
    memory: a start-up error with the numbers, not a CUDA out-of-memory traceback when the cache is allocated."""
    import dataclasses

    engine = _on_a_gpu(monkeypatch, tiny_engine, total=80 * GiB, free=30 * GiB, weights=16 * GiB, utilization=0.9)
    for asked, ok in ((29 * GiB, True), (100 * GiB, False)):
        cache = dataclasses.replace(engine.config.cache, kv_cache_memory_bytes=asked)
        monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, cache=cache))
        if ok:
            assert engine._plan({}).kv_cache_memory_bytes <= asked
            continue
        with pytest.raises(InvalidRequestError) as e:
            engine._plan({})
        says = ("kv_cache_memory_bytes=100.0 GiB", "30.0 GiB of the GPU's 80.0 GiB is free", "--kv-cache-memory-bytes")
        for part in says:
            assert part in str(e.value), str(e.value)
