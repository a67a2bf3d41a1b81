"""The engine sizes its running batch from the cache budget it has, and a model that cannot fit fails at start-up
with the numbers."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.core import fit_running_seqs
from hybridpd.engine.errors import InvalidRequestError


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
    with pytest.raises(
        InvalidRequestError,
        match=r"does not fit: one request of max_model_len=4096 tokens needs "
        r"[0-9.]+ MiB .* the cache budget is 0.1 MiB",
    ):
        LLM(kv_cache_memory_bytes=64 * 1024, max_model_len=4096)
