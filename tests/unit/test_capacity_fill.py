"""Capacity is exact: what `kv_cache_info()` promises can be filled, and no more.

For a NemotronH and a Qwen3.5 checkpoint (the latter with two attention layers) and an explicit budget:
1. the reported token capacity equals the analytic maximum, computed here from the layer specs alone (one arena:
   only the null, running and staging state slots are reserved, k whole pages each; a cached checkpoint takes k
   pages while it is cached, none is reserved):
       k              = ceil(bytes_per_state / bytes_per_block)
       reserved       = (1 (null) + max_num_seqs + STAGING_SLOTS) * k * bytes_per_block
       token_capacity = ((budget - reserved) // bytes_per_block - 1) * block_size
   and the runner's cache tensors are views of one arena of that many pages of those sizes plus the reserved
   slots; the arena is the budget;
2. a batch whose blocks sum to exactly the capacity (4 requests x 3 blocks = 12) is admitted at once, fills the
   attention pool to its last block and completes with no preemption;
3. the same batch with one more block's worth of tokens (one prompt 16 tokens longer: 13 blocks) PREEMPTS: all four
   are admitted (9 blocks), the first decode step needs 13, so the last-arrived request is preempted exactly once,
   waits until the others finish, and is recomputed: its tokens equal those of run 2, where it never was preempted.
"""

from __future__ import annotations

import math

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.specs import FullAttentionSpec, RecurrentStateSpec

from tests.oracle import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
MAX_SEQS = 4
CKPT_SLOTS = 3
BLOCKS = 12
"""Usable attention blocks the budget is sized for (block 0, the null block, comes on top)."""
NEW_TOKENS = 17  # a 32-token prompt + 16 computed generated tokens = 48 tokens = 3 blocks
FP32 = 4


def analytic_sizes(groups) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(bytes per attention block, bytes per state slot) over all layers, from the spec fields (fp32 caches)."""
    per_block = per_state = 0
    for g in groups:
        s = g.spec
        if isinstance(s, FullAttentionSpec):
            per_block += 2 * s.block_size * s.num_kv_heads * s.head_dim * FP32 * len(g.layer_ids)
        else:
            assert isinstance(s, RecurrentStateSpec)
            per_state += (math.prod(s.conv_shape) + math.prod(s.ssm_shape)) * FP32 * len(g.layer_ids)
    return per_block, per_state


def make_llm(path: str, budget: int) -> LLM:
    return LLM(model=path, kv_cache_memory_bytes=budget, max_num_seqs=MAX_SEQS, num_checkpoint_slots=CKPT_SLOTS,
               max_num_batched_tokens=1024, enable_prefix_caching=False, max_model_len=128)


def run(llm: LLM, prompts: list[list[int]]):  # type: ignore[no-untyped-def]
    """Generate; returns (outputs, requests running after the first step, fewest free pages seen)."""
    engine = llm.engine
    pool = engine.cache.pages
    seen = {"first": -1, "min_free": len(pool.free)}
    step = engine.step

    def spy():  # type: ignore[no-untyped-def]
        advanced = step()
        if seen["first"] < 0:
            seen["first"] = len(engine.scheduler.running)
        seen["min_free"] = min(seen["min_free"], len(pool.free))
        return advanced

    engine.step = spy  # type: ignore[method-assign]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    engine.cache.check_integrity()
    return outs, seen["first"], seen["min_free"]


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_first"])
def test_capacity_is_exact_and_fillable(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    probe = LLM(model=path, kv_cache_memory_bytes=64 * 2**20, max_model_len=128)
    per_block, per_state = analytic_sizes(probe.engine.groups)
    k = -(-per_state // per_block)
    slots = 1 + MAX_SEQS + STAGING_SLOTS
    reserved = slots * k * per_block
    # Room for BLOCKS + 1 blocks (null included) plus almost one more: the planner must round down.
    budget = reserved + (BLOCKS + 1) * per_block + per_block - 1

    llm = make_llm(path, budget)
    info = llm.kv_cache_info()
    capacity = ((budget - reserved) // per_block - 1) * BLOCK
    assert capacity == BLOCKS * BLOCK
    assert info["token_capacity"] == capacity and info["blocks_per_checkpoint"] == k
    assert (info["bytes_per_block"], info["bytes_per_state"]) == (per_block, per_state)
    runner = llm.engine.runner
    assert {t.shape[0] for t in runner.attention_tensors} == {BLOCKS + 1}
    assert {t.shape[0] for t in runner.state_tensors} == {slots}
    assert sum(t[0].nbytes for t in runner.attention_tensors) == per_block
    assert sum(t[0].nbytes for t in runner.state_tensors) == per_state
    storages = {t.untyped_storage().data_ptr() for t in runner.attention_tensors + runner.state_tensors}
    assert len(storages) == 1, "one arena backs every cache tensor"
    allocated = runner.attention_tensors[0].untyped_storage().nbytes()
    assert info["physical_bytes"] == reserved + (BLOCKS + 1) * per_block <= allocated < info["physical_bytes"] + 16
    # at most CKPT_SLOTS cached checkpoints, of k pages each out of the BLOCKS usable ones; none is cached yet
    assert info["state_slots_checkpoint"] == min(CKPT_SLOTS, BLOCKS // k) and info["max_checkpoints"] == CKPT_SLOTS
    assert info["checkpoint_bytes_held"] == 0
    assert llm.engine.cache.tree.max_checkpoints == CKPT_SLOTS
    assert info["physical_bytes"] <= budget < info["physical_bytes"] + per_block

    # Exactly full: 4 x (32-token prompt + 16 computed generated tokens) = 4 x 3 blocks = the capacity.
    long_prompt, *short = random_prompts([32 + BLOCK, 32, 32, 32], vocab=256, seed=3)
    exact = [long_prompt[:32], *short]
    assert sum(-(-(len(p) + NEW_TOKENS - 1) // BLOCK) for p in exact) * BLOCK == capacity
    outs, first, min_free = run(llm, exact)
    assert first == MAX_SEQS, "all requests should have been admitted in the first step"
    assert min_free == 0, "the run was meant to use every block"
    assert llm.engine.scheduler.num_preemptions == 0
    assert all(len(o.token_ids) == NEW_TOKENS and o.num_preemptions == 0 for o in outs)

    # One block's worth of tokens more (the first prompt 16 tokens longer): all admitted (3 + 2 + 2 + 2 = 9 blocks);
    # the first decode step needs 4 + 3 + 3 + 3 = 13 > 12 blocks: the last-arrived request is preempted, once.
    over = [long_prompt, *short]
    llm2 = make_llm(path, budget)
    outs2, first2, _ = run(llm2, over)
    assert first2 == MAX_SEQS, "all requests should have been admitted in the first step"
    assert llm2.engine.scheduler.num_preemptions == 1
    assert [o.num_preemptions for o in outs2] == [0, 0, 0, 1]
    assert [o.token_ids for o in outs2[1:]] == [o.token_ids for o in outs[1:]], "recompute changed the output"
