"""Prefix cache v2 on tiny pools, no model: reuse admission, one byte budget, value eviction (exact ids and hits).

Block 4 tokens; an attention block costs 32 bytes, a Mamba-2 state 160 bytes (= 5 blocks):

    prefix P (12 tokens) | suffix          admission: branch point (where a prompt leaves what was seen),
    0..3 | 4..7 | 8..11  | 12..             prompt end, (N-1) // 4 * 4, and a rolling request end while decoding
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.planner import plan_capacity
from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.cache.tree import BLOCK as BLOCK_ITEM
from hybridpd.engine.cache.tree import STATE as STATE_ITEM
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerOutput

from benchmarks.cache_policies import LruTree, fixed_interval

BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")  # 64 B/layer
MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")  # 80 B/layer
GROUPS = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))]
BLOCK, STATE = 64, 160
P = list(range(100, 112))


def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty


def make(
    budget: int = 10_000,
    policy: CachePolicy | None = None,
    blocks: int = 64,
    slots: int = 16,
    max_num_seqs: int = 2,
    groups: list[CacheGroup] = GROUPS,
) -> Scheduler:
    layout = PoolLayout(blocks, slots, 0, BS, budget, policy or CachePolicy())
    return Scheduler(SchedulerConfig(max_num_seqs, 64), HybridCacheManager(groups, layout))


def serve(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 1) -> tuple[Request, list[SchedulerOutput]]:
    req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
    s.add_request(req)
    outs = []
    while s.num_unfinished:
        out = s.schedule()
        outs.append(out)
        for r in s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample}):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                s.finish(r, "length")
        s.cache.check_integrity()
    return req, outs


def boundaries(outs: list[SchedulerOutput]) -> list[int]:
    return [b for o in outs for q in o.seqs for b, _ in lead(q.group_checkpoints)]


def test_group_page_sizes() -> None:
    assert (GROUPS[0].page_bytes_all_layers, GROUPS[1].page_bytes_all_layers) == (BLOCK, STATE)


# -- admission ---------------------------------------------------------------------------------------------------
def test_branch_point_is_saved_by_the_second_request_and_hit_by_the_third() -> None:
    s = make()
    a, outs = serve(s, "a", P + [1, 2, 3])  # 15 tokens
    assert boundaries(outs) == [12]  # nothing seen before: only the prompt end (15 -> 12, (N-1) -> 12)
    b, outs = serve(s, "b", P + [4, 5, 6, 7, 8])  # 17 tokens: shares 12 with a, where a has a checkpoint
    assert b.num_cached_tokens == 12 and boundaries(outs) == [16]
    c, outs = serve(s, "c", P[:10] + [9, 9, 9, 9, 9])  # leaves P inside block 2: branch point 8 (2 blocks seen)
    assert c.num_cached_tokens == 0 and boundaries(outs) == [8, 12]
    d, _ = serve(s, "d", P[:10] + [5, 5, 5, 5])
    assert d.num_cached_tokens == 8  # c saved the branch point


def test_identical_prompt_hits_below_n_minus_one_and_prompt_end_serves_extensions() -> None:
    s = make()
    _, outs = serve(s, "a", P + [1, 2, 3, 4])  # 16 tokens: prompt end 16, and (N-1) // 4 * 4 = 12
    assert boundaries(outs) == [12, 16]
    again, _ = serve(s, "a2", P + [1, 2, 3, 4])
    assert again.num_cached_tokens == 12
    longer, _ = serve(s, "a3", P + [1, 2, 3, 4, 5, 6])
    assert longer.num_cached_tokens == 16


def test_rolling_request_end_keeps_only_the_last_and_serves_the_next_turn() -> None:
    s = make()
    turn1, outs = serve(s, "t1", P + [1], max_tokens=10)  # 13-token prompt, 9 tokens computed while decoding
    assert boundaries(outs) == [12, 16, 20]  # prompt end 12, rolling ends 16 and 20 (computed 22 -> 20)
    rec = s.cache.recurrent
    assert rec is not None
    cached = {rec.pool.block_hash[b] for b in range(1, rec.pool.num_blocks)} - {None}
    assert turn1.block_hashes[4 - 1] not in cached  # the rolling end at 16 was replaced by 20
    assert {turn1.block_hashes[3 - 1], turn1.block_hashes[5 - 1]} <= cached
    turn2, _ = serve(s, "t2", turn1.all_token_ids + [50, 51, 52])
    assert turn2.num_cached_tokens == 20


def test_interval_fallback_and_fixed_interval_policy() -> None:
    s = make(policy=CachePolicy(interval=8))
    _, outs = serve(s, "a", P + [1, 2, 3, 4, 5], max_tokens=5)  # 17 + 4 computed
    assert boundaries(outs) == [8, 16, 20]  # interval 8, prompt end 16 (= (N-1) // 4 * 4), rolling end 20
    policy, admission = fixed_interval(8)
    v1 = Scheduler(
        SchedulerConfig(2, 64),
        HybridCacheManager(GROUPS, PoolLayout(64, 16, 0, BS, 10_000, policy), admission_cls=admission),
    )
    _, outs = serve(v1, "a", P + [1, 2, 3, 4, 5], max_tokens=5)
    assert boundaries(outs) == [8, 16]


def test_seen_hashes_forget_oldest_beyond_capacity() -> None:
    small = Admission(CachePolicy(seen_capacity=3), BS)
    small.note([b"a", b"b", b"c", b"d"])
    assert list(small.seen) == [b"b", b"c", b"d"]  # the oldest forgotten
    assert small.targets([b"b", b"c", b"x", b"d"], hit_tokens=0, prompt_end=16) == [8, 16]  # branches after 2 seen
    adm = Admission(CachePolicy(), BS)
    adm.note([b"h0", b"h1"])
    assert adm.targets([b"h0", b"h1", b"h2"], hit_tokens=0, prompt_end=12) == [8, 12]
    assert adm.targets([b"h0", b"h1", b"h2"], hit_tokens=8, prompt_end=12) == [12]


# -- one budget and value eviction ---------------------------------------------------------------------------------
def test_one_budget_blocks_and_states_evict_each_other() -> None:
    # budget: 2 running states + 8 blocks. a leaves 4 cached blocks + 1 checkpoint (12 is its prompt end).
    s = make(budget=2 * STATE + 8 * BLOCK)
    rc = s.cache.tree
    assert rc is not None
    serve(s, "a", P + [1])
    assert rc.held_bytes() == 3 * BLOCK + STATE  # a's 3 full blocks (its partial one holds nothing) + 1 state
    # b (unique, 28 tokens = 7 blocks + 1 running state) needs more than the free budget: a's cache goes,
    # dead-end and checkpointed chain alike, blocks and state consistently
    b, _ = serve(s, "b", list(range(500, 528)))
    assert b.num_cached_tokens == 0
    assert rc.held_bytes() <= rc.budget_bytes
    assert rc.state.num_evictions >= 1 and rc.chain.num_evictions >= 1
    again, _ = serve(s, "a2", P + [1])
    assert again.num_cached_tokens == 0  # nothing half-kept: no state without its chain


def test_dead_end_blocks_go_before_checkpointed_chains() -> None:
    s = make(budget=2 * STATE + 12 * BLOCK + STATE)
    rc = s.cache.tree
    assert rc is not None
    serve(s, "a", P + [1])  # chain of 3 full blocks with a checkpoint at 12
    serve(s, "x", [7] * 9, max_tokens=1)  # 2 full blocks, prompt end 8: checkpointed too
    serve(s, "y", [8] * 6)  # 1 full block + prompt end 4
    # make a state go: the block it ended on becomes a dead end and is evicted before any checkpointed chain
    rec = s.cache.recurrent
    assert rec is not None
    slot = rec.pool.lookup(_hash(s, P + [1], 3))
    assert slot is not None
    rc.evict(STATE_ITEM, slot)
    pool = s.cache.attention.pool  # type: ignore[union-attr]
    top = rc._lowest(BLOCK_ITEM)
    assert top is not None and pool.block_hash[top[1]] == _hash(s, P + [1], 3)
    assert top[2] == rc.clock  # valued 0
    s.cache.check_integrity()


def _hash(s: Scheduler, tokens: list[int], nblocks: int) -> bytes:
    r = Request("probe", list(tokens), SamplingParams(max_tokens=1))
    s.cache.update_hashes(r)
    return r.block_hashes[nblocks - 1]


def test_a_restored_checkpoint_outlives_an_unused_one_of_equal_value() -> None:
    s = make()
    rc = s.cache.tree
    assert rc is not None
    serve(s, "a", P + [1])
    serve(s, "b", list(range(300, 313)))  # same length, unique
    serve(s, "a2", P + [2])  # restores a's checkpoint at 12
    rec = s.cache.recurrent
    assert rec is not None
    ha, hb = _hash(s, P + [1], 3), _hash(s, list(range(300, 313)), 3)
    sa, sb = rec.pool.lookup(ha), rec.pool.lookup(hb)
    assert sa is not None and sb is not None and rc.nodes[ha].last_hit is not None
    rank = rc.queued[STATE_ITEM]
    assert rank[sa][:2] > rank[sb][:2]  # same value; the restore re-released a's state later (recency)
    assert rc._lowest(STATE_ITEM)[1] != sa  # type: ignore[index]


def test_lru_baseline_evicts_in_release_order_across_pools() -> None:
    layout = PoolLayout(64, 16, 0, BS, 2 * STATE + 8 * BLOCK, CachePolicy())
    s = Scheduler(SchedulerConfig(2, 64), HybridCacheManager(GROUPS, layout, tree_cls=LruTree))
    serve(s, "a", P + [1])
    serve(s, "b", list(range(500, 528)))
    s.cache.check_integrity()
    assert s.cache.tree is not None and s.cache.tree.state.num_evictions >= 1


def test_transfer_checkpoint_reserved_at_a_block_boundary_and_kept() -> None:
    s = make()
    req = Request("d", P + [1, 2, 3], SamplingParams(max_tokens=1))
    alloc = s.cache.allocate_for_transfer(req, 14)
    assert alloc is not None and alloc.first_block_index == 0
    got = s.cache.reserve_checkpoint(req, 12)  # a block boundary: no interval needed
    assert got is not None
    rc, rec = s.cache.tree, s.cache.recurrent
    assert rc is not None and rec is not None
    slot, h = got.slots[rec.group.group_id], got.block_hash
    assert s.cache.reserve_checkpoint(req, 10) is None  # not a boundary
    s.cache.publish_transferred(req, 14)
    s.cache.publish_checkpoint(got)
    assert rec.pool.lookup(h) == slot and rc.nodes[h].tokens == 12 and slot in rc.queued[STATE_ITEM]
    s.cache.free(req)
    s.cache.check_integrity()
    hit = s.cache.find_prefix_hit(Request("e", P + [5, 5], SamplingParams(max_tokens=1)))
    assert hit.num_tokens == 12 and hit.pages[rec.group.group_id] == (slot,)


# -- planner and config ------------------------------------------------------------------------------------------
def test_planner_reserves_only_running_states() -> None:
    """One arena: the null and running slots are reserved (each rounded up to k = 3 blocks), checkpoint ids overlay
    attention blocks (engine/cache/arena.py), so what is allocated is the budget."""
    budget = 100 * BLOCK + 3 * STATE + 10
    plan = plan_capacity(GROUPS, budget, 2, 40, 64, 0, policy=CachePolicy())
    k = 3  # ceil(160 / 64)
    assert plan.blocks_per_checkpoint == k and plan.attention_blocks == (budget - 3 * k * BLOCK) // BLOCK == 98
    assert plan.state_slots_checkpoint == 98 // k - 1 == 31 and plan.state_slots == 1 + 2 + 1 + 31
    assert plan.shared_budget == 1 and plan.budget_bytes == 97 * BLOCK + 2 * STATE
    assert plan.checkpoint_bytes_max == 31 * k * BLOCK
    assert plan.physical_bytes == 3 * k * BLOCK + 98 * BLOCK <= budget < plan.physical_bytes + BLOCK
    capped = plan_capacity(GROUPS, budget, 2, 4, 64, 0, policy=CachePolicy())
    assert capped.state_slots_checkpoint == 4 and capped.attention_blocks == 98
    v1 = plan_capacity(GROUPS, budget, 2, 4, 64, 8)  # v1: the 4 checkpoint slots are reserved up front
    assert v1.attention_blocks == (budget - 7 * STATE) // BLOCK and v1.shared_budget == 0
    layout = plan.layout()
    assert layout.budget_bytes == plan.budget_bytes and layout.policy == CachePolicy()
    assert v1.layout().budget_bytes is None and v1.layout().policy is None


def test_config_resolves_admission() -> None:
    assert CacheConfig().cache_policy() == CachePolicy()
    assert CacheConfig(checkpoint_interval=32).cache_policy() == CachePolicy(32)  # the fallback interval
    assert CacheConfig(checkpoint_interval=0).resolved_checkpoint_interval() == 0
    cfg = EngineConfig(ModelConfig("x"), CacheConfig(checkpoint_interval=6))
    with pytest.raises(InvalidRequestError, match="checkpoint_interval"):
        cfg.validate()
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        make(policy=CachePolicy(interval=6))


def test_attention_only_model_uses_the_budget_too() -> None:
    s = make(budget=8 * BLOCK, groups=[CacheGroup(0, ATTN, (0,))])
    a, _ = serve(s, "a", P + [1])
    b, _ = serve(s, "b", P + [2])
    assert b.num_cached_tokens == 12
    c, _ = serve(s, "c", list(range(600, 629)))  # 8 blocks: the whole budget, so a's and b's blocks go
    assert s.cache.attention is not None and s.cache.attention.pool.lookup(_hash(s, P + [1], 1)) is None
    assert s.cache.tree is not None and s.cache.tree.held_bytes() == 7 * BLOCK  # c's full blocks


def test_superseded_checkpoints_on_an_unbranched_path_keep_only_recency() -> None:
    s = make()
    rc, rec = s.cache.tree, s.cache.recurrent
    assert rc is not None and rec is not None
    t1, _ = serve(s, "t1", P + [1], max_tokens=10)  # prompt end 12, rolling end 20
    end1 = t1.block_hashes[5 - 1]
    t2, outs = serve(s, "t2", t1.all_token_ids + [50, 51, 52], max_tokens=6)  # restores 20, rolling end 28
    assert t2.num_cached_tokens == 20 and boundaries(outs) == [24, 28]
    assert rc.nodes[end1].demoted and rc._value(STATE_ITEM, end1) == 0.0  # turn 2 went on past it: recency only
    assert rc._since_hit(rec.pool.lookup(end1)) is None  # type: ignore[arg-type]  # restored by t2, then superseded
    assert rc.nodes[t1.block_hashes[3 - 1]].demoted  # turn 1's prompt end, superseded by turn 1's own end
    # a checkpoint two requests branched from is a branch point: never demoted, and a restore undoes a demotion
    serve(s, "b", t1.all_token_ids[:20] + [9, 9, 9], max_tokens=1)
    since = rc._since_hit(rec.pool.lookup(end1))  # type: ignore[arg-type]
    assert not rc.nodes[end1].demoted and since is not None and since <= rc.served_window  # restored, recent
    s.cache.check_integrity()
