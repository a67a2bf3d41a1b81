"""Asynchronous scheduling at its edges: what the synchronous engine does and the run-ahead could get out of order
(engine/async_step.py). Each test compares against the synchronous engine, or against what it would hold."""

from __future__ import annotations

from typing import Any

import pytest
from hybridpd.engine import SamplingParams

from tests.oracle import random_prompts
from tests.unit.test_async_scheduling import _cache_state, _engines, _same

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_late_checkpoint_of_a_request_ending_on_its_boundary_is_published_before_the_free(
    checkpoint_dir: Any,
) -> None:
    """A request's last step (max_tokens: known, so it is not in the step after) crosses a block boundary in a step
    launched ahead: its rolling checkpoint is copied and published one step late, and the request must be freed
    only after that publication, as the synchronous engine publishes then frees. Freed first, the publication
    found no request: it left a request-end entry behind for a request that is gone, and did not replace the
    request's previous rolling checkpoint (the cache kept one checkpoint more than the synchronous engine)."""
    sync, fast = _engines(checkpoint_dir("nemotron_attn_mid"))
    prompts = random_prompts([10, 12], sync.engine.vocab_size, seed=1)
    params = [  # 10 + 23 - 1 = 32 tokens computed at the last step: a boundary; the other request keeps running
        SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    ]
    _same(*[llm.generate(prompt_token_ids=prompts, sampling_params=params) for llm in (sync, fast)])
    assert fast.engine.pipeline.num_late_checkpoints > 0
    assert fast.engine.cache.rolling == {}
    assert _cache_state(sync) == _cache_state(fast)


def test_a_checkpoint_interval_leaves_only_boundary_steps_synchronous(checkpoint_dir: Any) -> None:
    """With a fixed checkpoint interval every decode row that reaches a block boundary saves a checkpoint planned
    with its step's token (a synchronous step), but the steps in between save nothing and run ahead; the results
    and the cache (those checkpoints included) are the synchronous engine's."""
    sync, fast = _engines(checkpoint_dir("nemotron_attn_mid"), checkpoint_interval=32)
    prompts = random_prompts([10, 12, 30], sync.engine.vocab_size, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _same(*[llm.generate(prompt_token_ids=prompts, sampling_params=params) for llm in (sync, fast)])
    pipe = fast.engine.pipeline
    assert pipe.num_ahead > 20 and pipe.num_sync_fallbacks > 0 and pipe.num_late_checkpoints == 0
    assert _cache_state(sync) == _cache_state(fast)
