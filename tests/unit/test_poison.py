"""Poisoned caches: garbage in memory the engine does not own must never reach an output.

Before EVERY engine step, every cache row that holds nothing the engine promises to keep is overwritten with NaN
(or 1e30, which overflows to inf/NaN as soon as it is multiplied):

- block 0 (the null block) of every attention layer and slot 0 (the null slot) of every recurrent layer;
- every free page of the arena (what an allocation may hand out) and every free state slot (conv and SSM; staging
  slots included).

Cached pages are prefix content (attention blocks, the pages of recurrent checkpoints): a later hit reads them, so
the engine must keep them and this test leaves them alone. With prefix caching off nothing is ever cached, so there
every free page and slot is poisoned.

What this proves (fp32, greedy, identical tokens and logprobs within 1e-4 of transformers):
- the null block / null slot are never read (nor written: they still hold the poison after every step);
- a freshly allocated attention block is only read at positions written before (with zeroing off too: the real
  attention gathers only valid positions, see `paged_attention`);
- a new request's running state slot (allocated from the poisoned free slots) is never read before it is written
  (`has_initial_state=False`), and padded rows never alias a slot (PAD_SLOT_ID = -1 would index the last slot);
- prefix hits keep their contents while everything around them is poisoned.
The test is not vacuous: every fresh block and every new running slot of every step is checked to be one that was
poisoned just before that step. The FlashAttention-style failure (multiply-by-zero masking) and the
zeroing that guards against it are covered in test_zeroing_engine.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.specs import PAD_SLOT_ID

from tests.oracle import reference_set
from tests.support.pool_views import free_pages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
NEW_TOKENS = 16
FAMILIES = ["nemotron_attn_mid", "qwen_attn_first"]
POISONS = {"nan": float("nan"), "1e30": 1e30}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty



@pytest.fixture(scope="module")
def reference(checkpoint_dir):  # type: ignore[no-untyped-def]
    return lambda name: reference_set(checkpoint_dir(name), tuple(LENGTHS), NEW_TOKENS)


def holds_poison(t: torch.Tensor, value: float) -> bool:
    return bool(torch.isnan(t).all()) if math.isnan(value) else bool((t == value).all())


class Poisoner:
    """Wraps `engine.step`: poisons before every step, then checks the null block/slot still hold the poison.
    Spies on `runner.launch` (what a synchronous `execute` and an asynchronous step both call) to count how many
    fresh blocks and new running slots came from poisoned memory."""

    def __init__(self, engine, value: float) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.value = engine, value
        self.blocks: set[int] = set()
        self.slots: set[int] = set()
        self.fresh_blocks = self.fresh_blocks_poisoned = 0
        self.new_slots = self.new_slots_poisoned = 0
        self.steps = 0
        self._started: set[str] = set()
        self._step, self._launch = engine.step, engine.runner.launch
        engine.step = self.step
        engine.runner.launch = self.launch

    def poison(self) -> None:
        cache, runner = self.engine.cache, self.engine.runner
        self.blocks = {0} | free_pages(cache)  # the null page and every free page (cached ones hold prefix content)
        self.slots = {0, *cache.slots.free}  # the null slot and every free slot (staging ones included)
        blocks = torch.tensor(sorted(self.blocks), dtype=torch.int64)
        slots = torch.tensor(sorted(self.slots), dtype=torch.int64)
        for kv in runner.attention_tensors:
            kv[blocks] = self.value
        for t in runner.state_tensors:
            t[slots] = self.value

    def step(self):  # type: ignore[no-untyped-def]
        self.poison()
        advanced = self._step()
        self.steps += 1
        for kv in self.engine.runner.attention_tensors:
            assert holds_poison(kv[0], self.value), f"step {self.steps}: the null attention block was written"
        for t in self.engine.runner.state_tensors:
            assert holds_poison(t[0], self.value), f"step {self.steps}: the null state slot was written"
        return advanced

    def launch(self, out, params, feed=None):  # type: ignore[no-untyped-def]
        self.fresh_blocks += len(lead(out.group_fresh_blocks))
        self.fresh_blocks_poisoned += sum(b in self.blocks for b in lead(out.group_fresh_blocks))
        for s in out.seqs:
            if s.request_id not in self._started:  # first chunk: the running slot was just allocated
                self._started.add(s.request_id)
                self.new_slots += 1
                self.new_slots_poisoned += lead(s.group_state_slots, PAD_SLOT_ID) in self.slots
        return self._launch(out, params, feed)


def assert_matches(outputs, expected) -> None:  # type: ignore[no-untyped-def]
    for i, (out, (toks, lps)) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == toks, f"prompt {i} ({LENGTHS[i]} tokens): greedy tokens differ"
        assert all(math.isfinite(lp) for lp in out.logprobs), f"prompt {i}: non-finite logprob {out.logprobs}"
        diff = max(abs(a - b) for a, b in zip(out.logprobs, lps, strict=True))
        assert diff < 1e-4, f"prompt {i}: logprob diff {diff}"


@pytest.mark.parametrize("zeroing", ["auto", "off"])
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("name", FAMILIES)
def test_poisoned_free_caches_leave_outputs_identical(name, poison, zeroing, checkpoint_dir, reference):  # type: ignore[no-untyped-def]
    """Prefix caching off: every free block and slot is poisoned before every step; 8 prompts (1..300 tokens)
    chunked by a 48-token budget and mixed with decodes. zeroing=off shows the real attention does not depend on
    zeroing; zeroing=auto (on for these hybrid models) is the default path."""
    prompts, expected = reference(name)
    llm = LLM(model=checkpoint_dir(name), max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 * 2**20, max_model_len=512, zero_fresh_blocks=zeroing)
    poisoner = Poisoner(llm.engine, POISONS[poison])
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert_matches(outs, expected)
    assert poisoner.steps >= sum(LENGTHS) // 48, "prompts were meant to be chunked"
    # Not vacuous: every block / slot the engine handed out came from memory poisoned just before that step.
    assert poisoner.fresh_blocks == poisoner.fresh_blocks_poisoned > 0
    assert poisoner.new_slots == poisoner.new_slots_poisoned == len(prompts)
    llm.engine.cache.check_integrity()


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("name", FAMILIES)
def test_prefix_hits_survive_poisoned_neighbours(name, poison, checkpoint_dir, reference):  # type: ignore[no-untyped-def]
    """Prefix caching on, the same 8 prompts twice: only unhashed free blocks/slots are poisoned (hashed ones are
    the content a hit reuses). The second pass hits (its prompt-end checkpoint, the last block boundary <= N-1)
    and is still exact.
    (64 checkpoint slots: the 22 checkpoints of a pass all stay; with 16, LRU evicts the early ones.)"""
    prompts, expected = reference(name)
    llm = LLM(model=checkpoint_dir(name), max_num_batched_tokens=48, max_num_seqs=8, checkpoint_interval=32,
              num_checkpoint_slots=64, kv_cache_memory_bytes=64 * 2**20, max_model_len=512)  # no checkpoint evicted
    poisoner = Poisoner(llm.engine, POISONS[poison])
    assert_matches(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY), expected)
    second = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert_matches(second, expected)
    assert [o.num_cached_tokens for o in second] == [((len(p) - 1) // 16) * 16 for p in prompts]
    assert poisoner.fresh_blocks_poisoned > 0 and poisoner.new_slots_poisoned > 0
    llm.engine.cache.check_integrity()
