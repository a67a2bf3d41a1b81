"""Poisoned caches with tensor parallelism: before every step, the null block/slot and every free unhashed block and
slot are overwritten with NaN on EVERY rank (engine.parallel.handoff.on_ranks), and after the step the null
block/slot must still hold the poison on every rank. TP 2 tokens and logprobs must equal the unpoisoned TP 1
engine's (itself checked against transformers in test_engine_oracle.py). Not vacuous: every fresh block and new
running slot came from poisoned memory (the Poisoner of test_poison.py counts them)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.parallel.handoff import on_ranks

from tests.oracle import random_prompts
from tests.unit.test_poison import Poisoner, holds_poison

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENGTHS = [1, 33, 129]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SETTINGS: dict[str, Any] = {
    "max_num_batched_tokens": 48,
    "max_num_seqs": 8,
    "enable_prefix_caching": False,
    "kv_cache_memory_bytes": 16 * 2**20,
    "max_model_len": 256,
    "zero_fresh_blocks": "off",
}


def _poison(runner: Any, rank: int, blocks: list[int], slots: list[int], value: float) -> None:
    for kv in runner.attention_tensors:
        kv[torch.tensor(blocks, dtype=torch.int64)] = value
    for t in runner.state_tensors:
        t[torch.tensor(slots, dtype=torch.int64)] = value


def _null_untouched(runner: Any, rank: int, value: float) -> bool:
    return all(holds_poison(t[0], value) for t in [*runner.attention_tensors, *runner.state_tensors])


class RankPoisoner(Poisoner):
    def __init__(self, engine: Any, value: float) -> None:
        """The spy on `launch` goes on rank 0's own runner: a synchronous step is the LeaderRunner's `execute`,
        whose runner then calls its own `launch` (a spy on the LeaderRunner would see asynchronous steps only);
        an asynchronous one is the LeaderRunner's `launch`, which calls the same runner's `launch`."""
        super().__init__(engine, value)
        leader, inner = engine.runner, engine.runner._runner
        del leader.__dict__["launch"]  # Poisoner's spy, set on the LeaderRunner
        self._launch, inner.launch = inner.launch, self.launch

    def poison(self) -> None:
        super().poison()  # picks the unowned blocks / slots (and poisons rank 0)
        on_ranks(self.engine, _poison, sorted(self.blocks), sorted(self.slots), self.value)

    def step(self):  # type: ignore[no-untyped-def]
        advanced = super().step()
        assert all(on_ranks(self.engine, _null_untouched, self.value)), f"step {self.steps}: a rank wrote null pages"
        return advanced


def test_poisoned_free_caches_on_every_rank_leave_tp2_outputs_identical(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint_dir("nemotron_attn_mid")
    prompts = random_prompts(LENGTHS, 256, seed=5)
    want = LLM(model=path, **SETTINGS).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    llm = LLM(model=path, tensor_parallel_size=2, **SETTINGS)
    try:
        poisoner = RankPoisoner(llm.engine, float("nan"))
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        for o, w in zip(outs, want, strict=True):
            assert o.token_ids == w.token_ids
            assert all(math.isfinite(lp) for lp in o.logprobs)
            assert max(abs(a - b) for a, b in zip(o.logprobs, w.logprobs, strict=True)) < 1e-4
        assert poisoner.fresh_blocks == poisoner.fresh_blocks_poisoned > 0
        assert poisoner.new_slots == poisoner.new_slots_poisoned == len(prompts)
    finally:
        llm.shutdown()
