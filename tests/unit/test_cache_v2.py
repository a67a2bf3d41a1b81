"""Prefix cache v2 on tiny pools, no model: reuse admission, one page pool, value eviction (exact ids and hits).

Block 4 tokens; an attention block (a page) costs 64 bytes, a Mamba-2 state 160 bytes: a cached checkpoint takes
k = 3 pages, shared with the blocks:

    prefix P (12 tokens) | suffix          admission: branch point (where a prompt leaves what was seen),
    0..3 | 4..7 | 8..11  | 12..             prompt end, (N-1) // 4 * 4, and a rolling request end while decoding
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS
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
K = 3  # pages per checkpoint: ceil(160 / 64)
P = list(range(100, 112))


def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty


def make(
    pages: int = 64,
    policy: CachePolicy | None = None,
    max_num_seqs: int = 2,
    groups: list[CacheGroup] = GROUPS,
) -> Scheduler:
    """`pages` pages (the null page included), running and staging slots for `max_num_seqs`."""
    layout = PoolLayout(pages, 1 + max_num_seqs + STAGING_SLOTS, 0, BS, K, policy or CachePolicy())
    return Scheduler(SchedulerConfig(max_num_seqs, 64), HybridCacheManager(groups, layout))


def cached_checkpoints(s: Scheduler) -> set[bytes]:
    return {h for h, n in s.cache.tree.nodes.items() if n.ckpt is not None}


def cached_blocks(s: Scheduler) -> set[bytes]:
    return {h for h, n in s.cache.tree.nodes.items() if n.page}


def serve(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 1) -> tuple[Request, list[int]]:
    """Run the request to its end; returns it and the boundaries (tokens) of the checkpoints its steps saved."""
    req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
    s.add_request(req)
    saved: list[int] = []
    while s.num_unfinished:
        out = s.schedule()
        saved += boundaries(s, out)
        for r in s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample}):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                s.finish(r, "length")
        s.cache.check_integrity()
    return req, saved


def boundaries(s: Scheduler, out: SchedulerOutput) -> list[int]:
    """The checkpoints a step saves: one copy after the step each (`state_saves`), from a staging slot for those
    inside a chunk (`group_checkpoints`), else from the running slot at the chunk's end."""
    pending = s.cache.pending
    assert [pages for _, pages in out.state_saves] == [p.pages for p in pending]
    ends = {q.num_computed_tokens + q.num_new_tokens for q in out.seqs}
    inside = [b for q in out.seqs for b, _ in lead(q.group_checkpoints)]
    assert sorted(inside) == sorted(p.num_tokens for p in pending if p.num_tokens not in ends)
    return [p.num_tokens for p in pending]


def test_group_page_sizes() -> None:
    assert (GROUPS[0].page_bytes_all_layers, GROUPS[1].page_bytes_all_layers) == (BLOCK, STATE)


# -- admission ---------------------------------------------------------------------------------------------------
def test_branch_point_is_saved_by_the_second_request_and_hit_by_the_third() -> None:
    s = make()
    a, saved = serve(s, "a", P + [1, 2, 3])  # 15 tokens
    assert saved == [12]  # nothing seen before: only the prompt end (15 -> 12, (N-1) -> 12)
    b, saved = serve(s, "b", P + [4, 5, 6, 7, 8])  # 17 tokens: shares 12 with a, where a has a checkpoint
    assert b.num_cached_tokens == 12 and saved == [16]
    c, saved = serve(s, "c", P[:10] + [9, 9, 9, 9, 9])  # leaves P inside block 2: branch point 8 (2 blocks seen)
    assert c.num_cached_tokens == 0 and saved == [8, 12]
    d, _ = serve(s, "d", P[:10] + [5, 5, 5, 5])
    assert d.num_cached_tokens == 8  # c saved the branch point


def test_identical_prompt_hits_below_n_minus_one_and_prompt_end_serves_extensions() -> None:
    s = make()
    _, saved = serve(s, "a", P + [1, 2, 3, 4])  # 16 tokens: prompt end 16, and (N-1) // 4 * 4 = 12
    assert saved == [12, 16]
    again, _ = serve(s, "a2", P + [1, 2, 3, 4])
    assert again.num_cached_tokens == 12
    longer, _ = serve(s, "a3", P + [1, 2, 3, 4, 5, 6])
    assert longer.num_cached_tokens == 16


def test_rolling_request_end_keeps_only_the_last_and_serves_the_next_turn() -> None:
    s = make()
    turn1, saved = serve(s, "t1", P + [1], max_tokens=10)  # 13-token prompt, 9 tokens computed while decoding
    assert saved == [12, 16, 20]  # prompt end 12, rolling ends 16 and 20 (computed 22 -> 20)
    cached = cached_checkpoints(s)
    assert turn1.block_hashes[4 - 1] not in cached  # the rolling end at 16 was replaced by 20
    assert {turn1.block_hashes[3 - 1], turn1.block_hashes[5 - 1]} <= cached
    turn2, _ = serve(s, "t2", turn1.all_token_ids + [50, 51, 52])
    assert turn2.num_cached_tokens == 20


def test_interval_fallback_and_fixed_interval_policy() -> None:
    s = make(policy=CachePolicy(interval=8))
    _, saved = serve(s, "a", P + [1, 2, 3, 4, 5], max_tokens=5)  # 17 + 4 computed
    assert saved == [8, 16, 20]  # interval 8, prompt end 16 (= (N-1) // 4 * 4), rolling end 20
    policy, admission = fixed_interval(8)
    v1 = Scheduler(
        SchedulerConfig(2, 64),
        HybridCacheManager(GROUPS, PoolLayout(64, 5, 0, BS, K, policy), admission_cls=admission),
    )
    _, saved = serve(v1, "a", P + [1, 2, 3, 4, 5], max_tokens=5)
    assert saved == [8, 16]


def test_seen_hashes_forget_oldest_beyond_capacity() -> None:
    small = Admission(CachePolicy(seen_capacity=3), BS)
    small.note([b"a", b"b", b"c", b"d"])
    assert list(small.seen) == [b"b", b"c", b"d"]  # the oldest forgotten
    assert small.targets([b"b", b"c", b"x", b"d"], hit_tokens=0, prompt_end=16) == [8, 16]  # branches after 2 seen
    adm = Admission(CachePolicy(), BS)
    adm.note([b"h0", b"h1"])
    assert adm.targets([b"h0", b"h1", b"h2"], hit_tokens=0, prompt_end=12) == [8, 12]
    assert adm.targets([b"h0", b"h1", b"h2"], hit_tokens=8, prompt_end=12) == [12]


# -- one page pool and value eviction ------------------------------------------------------------------------------
def test_one_page_pool_blocks_and_checkpoints_evict_each_other() -> None:
    # 8 usable pages. a leaves 3 cached blocks + 1 checkpoint of 3 pages (12 is its prompt end).
    s = make(pages=9)
    rc, pages = s.cache.tree, s.cache.pages
    serve(s, "a", P + [1])
    assert len(cached_blocks(s)) == 3 and rc.num_checkpoints == 1  # a's 3 full blocks (its partial one holds
    assert pages.num_checkpoint_pages == K and len(pages.free) == 8 - 3 - K  # nothing) + one state in 3 pages
    # b (unique, 28 tokens = 7 blocks) needs more than the free pages: a's cache goes, dead-end and checkpointed
    # chain alike, blocks and state consistently
    b, _ = serve(s, "b", list(range(500, 528)))
    assert b.num_cached_tokens == 0
    assert rc.num_evictions[STATE_ITEM] >= 1 and rc.num_evictions[BLOCK_ITEM] >= 1
    assert len(cached_blocks(s)) + pages.num_checkpoint_pages + len(pages.free) == 8
    again, _ = serve(s, "a2", P + [1])
    assert again.num_cached_tokens == 0  # nothing half-kept: no state without its chain


def test_dead_end_blocks_go_before_checkpointed_chains() -> None:
    s = make(pages=1 + 12 + 3 * K)
    rc = s.cache.tree
    serve(s, "a", P + [1])  # chain of 3 full blocks with a checkpoint at 12
    serve(s, "x", [7] * 9, max_tokens=1)  # 2 full blocks, prompt end 8: checkpointed too
    serve(s, "y", [8] * 6)  # 1 full block + prompt end 4
    assert rc.num_checkpoints == 3
    low = rc._lowest()
    assert low is not None and low[1].ckpt is not None  # leaves with checkpoints: nothing is valued 0 yet
    # make a state go: the block it ended on becomes a dead end and is evicted before any checkpointed chain
    node = rc.nodes[_hash(s, P + [1], 3)]
    rc.evict_checkpoint(node)
    top = rc._lowest()
    assert top is not None and top[:2] == (BLOCK_ITEM, node) and node.ckpt is None
    assert top[2] == rc.clock  # valued 0
    s.cache.check_integrity()


def _hash(s: Scheduler, tokens: list[int], nblocks: int) -> bytes:
    r = Request("probe", list(tokens), SamplingParams(max_tokens=1))
    s.cache.update_hashes(r)
    return r.block_hashes[nblocks - 1]


def test_a_restored_checkpoint_outlives_an_unused_one_of_equal_value() -> None:
    s = make()
    rc = s.cache.tree
    serve(s, "a", P + [1])
    serve(s, "b", list(range(300, 313)))  # same length, unique
    a2, _ = serve(s, "a2", P + [2])  # restores a's checkpoint at 12
    assert a2.num_cached_tokens == 12
    na, nb = rc.nodes[_hash(s, P + [1], 3)], rc.nodes[_hash(s, list(range(300, 313)), 3)]
    assert na.ckpt is not None and nb.ckpt is not None and not na.ckpt_refs and not nb.ckpt_refs
    assert rc._value(STATE_ITEM, na) == rc._value(STATE_ITEM, nb) > 0
    assert na.queued[STATE_ITEM] > nb.queued[STATE_ITEM]  # same value; the restore re-queued a's state later
    assert na.base[STATE_ITEM] >= nb.base[STATE_ITEM]
    lowest = rc._lowest_checkpoint()
    assert lowest is not None and lowest[0] is nb  # b's goes first


def test_lru_baseline_evicts_in_release_order_across_kinds() -> None:
    layout = PoolLayout(9, 5, 0, BS, K, CachePolicy())
    s = Scheduler(SchedulerConfig(2, 64), HybridCacheManager(GROUPS, layout, tree_cls=LruTree))
    assert isinstance(s.cache.tree, LruTree)
    serve(s, "a", P + [1])
    serve(s, "b", list(range(500, 528)))
    s.cache.check_integrity()
    assert s.cache.tree.num_evictions[STATE_ITEM] >= 1 and s.cache.tree.num_evictions[BLOCK_ITEM] >= 1


def test_transfer_checkpoint_reserved_at_a_block_boundary_and_kept() -> None:
    s = make()
    req = Request("d", P + [1, 2, 3], SamplingParams(max_tokens=1))
    alloc = s.cache.allocate_for_transfer(req, 14)
    assert alloc is not None and alloc.first_block_index == 0
    free = set(s.cache.pages.free)
    got = s.cache.reserve_checkpoint(req, 12)  # a block boundary: no interval needed
    assert got is not None and got.num_tokens == 12 and got.block_hash == req.block_hashes[3 - 1]
    assert len(got.pages) == K and set(got.pages) <= free and all(s.cache.pages.ref[p] == 1 for p in got.pages)
    rc, h = s.cache.tree, got.block_hash
    assert s.cache.reserve_checkpoint(req, 10) is None  # not a boundary
    s.cache.publish_transferred(req, 14)
    s.cache.publish_checkpoint(got)
    node = rc.nodes[h]
    assert node.ckpt == got.pages and node.tokens == 12 and node.queued[STATE_ITEM]
    assert s.cache.reserve_checkpoint(req, 12) is None  # cached already
    s.cache.free(req)
    s.cache.check_integrity()
    hit = s.cache.find_prefix_hit(Request("e", P + [5, 5], SamplingParams(max_tokens=1)))
    assert hit.num_tokens == 12 and hit.checkpoint is node and hit.blocks == tuple(s.cache.tree.nodes[x].page
                                                                                   for x in req.block_hashes[:3])


# -- planner and config ------------------------------------------------------------------------------------------
def test_planner_reserves_only_running_and_staging_states() -> None:
    """One arena: the null, running and staging slots are reserved (k = 3 pages each); cached checkpoints take
    pages only while cached (engine/cache/arena.py), so what is allocated is the budget."""
    budget = 100 * BLOCK + 3 * STATE + 10
    plan = plan_capacity(GROUPS, budget, 2, 40, 64, 0, policy=CachePolicy())
    slots = 1 + 2 + STAGING_SLOTS
    assert plan.blocks_per_checkpoint == K and plan.state_slots == slots == 5
    assert plan.attention_blocks == (budget - slots * K * BLOCK) // BLOCK == 92
    assert plan.state_slots_checkpoint == 91 // K == 30  # what the pages could hold (under the cap of 40)
    assert plan.state_bytes == slots * K * BLOCK
    assert plan.physical_bytes == slots * K * BLOCK + 92 * BLOCK <= budget < plan.physical_bytes + BLOCK
    capped = plan_capacity(GROUPS, budget, 2, 4, 64, 0, policy=CachePolicy())
    assert capped.state_slots_checkpoint == 4 and capped.attention_blocks == 92  # a cap reserves nothing
    no_policy = plan_capacity(GROUPS, budget, 2, 4, 64, 8)  # the same arena with or without a policy
    assert no_policy.arena == capped.arena and no_policy.attention_blocks == 92
    layout = plan.layout()
    assert (layout.num_pages, layout.num_slots, layout.pages_per_state) == (92, 5, K)
    assert layout.policy == CachePolicy() and layout.max_checkpoints == 40 and capped.layout().max_checkpoints == 4
    assert no_policy.layout().policy is None and no_policy.layout().checkpoint_interval == 8
    cache = HybridCacheManager(GROUPS, capped.layout())
    assert cache.tree.max_checkpoints == 4 and cache.pages.capacity == 91 and cache.slots.capacity == 4


def test_config_resolves_admission() -> None:
    assert CacheConfig().cache_policy() == CachePolicy()
    assert CacheConfig(checkpoint_interval=32).cache_policy() == CachePolicy(32)  # the fallback interval
    assert CacheConfig(checkpoint_interval=0).resolved_checkpoint_interval() == 0
    cfg = EngineConfig(ModelConfig("x"), CacheConfig(checkpoint_interval=6))
    with pytest.raises(InvalidRequestError, match="checkpoint_interval"):
        cfg.validate()
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        make(policy=CachePolicy(interval=6))


def test_attention_only_model_uses_the_pages_too() -> None:
    s = make(pages=9, groups=[CacheGroup(0, ATTN, (0,))])
    a, _ = serve(s, "a", P + [1])
    b, _ = serve(s, "b", P + [2])
    assert b.num_cached_tokens == 12
    c, _ = serve(s, "c", list(range(600, 629)))  # 8 blocks: every page, so a's and b's blocks go
    assert _hash(s, P + [1], 1) not in s.cache.tree.nodes
    assert len(cached_blocks(s)) == 7 and len(s.cache.pages.free) == 1  # c's full blocks; its partial one is free
    assert s.cache.tree.num_checkpoints == 0 and s.cache.slots.capacity == 0


def test_superseded_checkpoints_on_an_unbranched_path_keep_only_recency() -> None:
    s = make()
    rc = s.cache.tree
    t1, _ = serve(s, "t1", P + [1], max_tokens=10)  # prompt end 12, rolling end 20
    end1 = t1.block_hashes[5 - 1]
    t2, saved = serve(s, "t2", t1.all_token_ids + [50, 51, 52], max_tokens=6)  # restores 20, rolling end 28
    assert t2.num_cached_tokens == 20 and saved == [24, 28]
    node = rc.nodes[end1]
    assert node.demoted and rc._value(STATE_ITEM, node) == 0.0  # turn 2 went on past it: recency only
    assert node.queued[STATE_ITEM] and _heap_priority(rc, node) == node.base[STATE_ITEM]  # its priority: recency
    assert rc.nodes[t1.block_hashes[3 - 1]].demoted  # turn 1's prompt end, superseded by turn 1's own end
    # a checkpoint two requests branched from is a branch point: never demoted, and a restore undoes a demotion
    b, _ = serve(s, "b", t1.all_token_ids[:20] + [9, 9, 9], max_tokens=1)
    assert b.num_cached_tokens == 20
    assert not node.demoted and rc._value(STATE_ITEM, node) > 0  # restored: valued again
    assert _heap_priority(rc, node) > node.base[STATE_ITEM]
    s.cache.check_integrity()


def _heap_priority(tree, node):  # type: ignore[no-untyped-def]
    """The priority of `node`'s live checkpoint entry in the tree's heap."""
    (prio,) = [e[0] for e in tree._heap if e[3] is node and e[2] == STATE_ITEM and e[1] == node.queued[STATE_ITEM]]
    return prio
