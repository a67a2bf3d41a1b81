"""One arena backs both pools: checkpoint slots share memory with attention blocks, and never while either
holds something.

    slot s at s * k * B;  block j at (1 + S) * k * B + j * B;  checkpoint slot F + c == blocks [c * k, (c + 1) * k)

1. planner: what is allocated is the budget (less than a block short); with no reuse the attention capacity is
   >= 0.99 of the one-state-per-running-request optimum at the issue's shapes;
2. control plane, exact ids: a checkpoint takes the lowest free range and the blocks under it leave the attention
   pool; attention takes blocks outside every range first, then one range at a time; with no free range a
   range's cached blocks are evicted, with the chains below them;
3. random traces (the harness of test_cache_properties with a shadow device that models the shared memory: writing
   a checkpoint clobbers the blocks under it and the reverse): every hit reads what it should, no held checkpoint
   overlaps a held or cached block, no leaks, integrity after every step;
4. tensors: the views share one storage and the overlay is physical (a checkpoint write lands on its blocks); the
   transfer layout registers the arena once and gives the right page addresses.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hybridpd.engine.arena import allocate_caches
from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.arena import ArenaLayout
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.managers import cdiv
from hybridpd.engine.cache.planner import plan_capacity
from hybridpd.engine.cache.specs import NULL_BLOCK_ID, PAD_SLOT_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerOutput
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.overlay_spy import spy_overlay
from tests.support.pool_views import own_refs, page_bytes, slot_blocks
from tests.unit.test_cache_properties import BS, GDN, Harness, ReqSpec, Trace, req_specs

GiB = 2**30
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
GROUPS = [CacheGroup(0, ATTN, (0, 3)), CacheGroup(1, GDN, (1, 2, 4))]
B = page_bytes(GROUPS[:1])  # 128
K = cdiv(page_bytes(GROUPS[1:]), B)  # 4

def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty



def arena_budget(max_num_seqs: int, blocks: int) -> int:
    return (1 + max_num_seqs) * K * B + blocks * B


# -- 1. planner ----------------------------------------------------------------------------------------------------
NEMO = [CacheGroup(0, FullAttentionSpec(16, 8, 128, "bfloat16"), (3, 7, 11, 15)),
        CacheGroup(1, RecurrentStateSpec("mamba2", (10240, 3), "bfloat16", (64, 64, 128), "float32"),
                   tuple(i for i in range(16) if i % 4 != 3))]


@pytest.mark.parametrize("budget_gib", [8, 20])
def test_physical_bytes_are_the_budget_and_capacity_is_optimal(budget_gib: int) -> None:
    budget, seqs = budget_gib * GiB, 64
    plan = plan_capacity(NEMO, budget, seqs, None, 8192, 0, policy=CachePolicy())
    block, state = plan.bytes_per_block, plan.bytes_per_state
    assert plan.physical_bytes <= budget < plan.physical_bytes + block
    optimum = (budget - seqs * state) // block  # one state per running request, everything else attention
    assert (plan.attention_blocks - 1) / optimum >= 0.99
    k = plan.blocks_per_checkpoint
    assert k == cdiv(state, block) and plan.state_slots_checkpoint == plan.attention_blocks // k - 1
    assert plan.layout().arena is plan.arena and plan.arena is not None
    assert plan.arena.total_bytes == plan.physical_bytes


def test_no_reuse_run_keeps_the_optimum_capacity() -> None:
    """After a no-reuse run filled the cache with whatever it keeps, running requests can still take >= 0.99 of
    the optimum (cached blocks and checkpoints are evicted for them; checkpoints free their whole range)."""
    seqs, blocks = 2, 80
    plan = plan_capacity(GROUPS, arena_budget(seqs, blocks), seqs, None, 64, 0, policy=CachePolicy())
    cache = HybridCacheManager(GROUPS, plan.layout())
    sched = Scheduler(SchedulerConfig(seqs, 64), cache)
    for i in range(12):
        r = Request(f"j{i}", [100 * i + t for t in range(30)], SamplingParams(max_tokens=6))
        sched.add_request(r)
    while sched.num_unfinished:
        out = sched.schedule()
        for r in sched.update_from_output(out, {s.request_id: (7, 0.0) for s in out.seqs if s.sample}):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                sched.finish(r, "length")
        cache.check_integrity()
    assert cache.overlay is not None and cache.overlay.held, "the run should have left checkpoints"
    small = Request("s", [1], SamplingParams(max_tokens=1))
    assert cache.allocate(small, 1)
    big = Request("big", [2], SamplingParams(max_tokens=1))
    n = 0
    while cache.allocate(big, n + BS):
        n += BS
    assert len(lead(cache.seq_tables("big")[0])) + 1 == blocks - 1  # every block but the null one
    assert cache.overlay.held == set()
    cache.check_integrity()


# -- 2. exact ids --------------------------------------------------------------------------------------------------
def test_checkpoints_take_the_lowest_free_range_and_blocks_stay_out_of_it() -> None:
    seqs, blocks = 1, 4 * K  # ranges 1, 2, 3 (range 0 holds the null block)
    plan = plan_capacity(GROUPS, arena_budget(seqs, blocks), seqs, None, 64, 0, policy=CachePolicy())
    assert plan.state_slots_checkpoint == 3 and plan.state_slots == 1 + 1 + 1 + 3
    cache = HybridCacheManager(GROUPS, plan.layout())
    attn, rec, ov = cache.blocks[0], cache.states[0], cache.overlay
    assert ov is not None
    a = Request("a", list(range(10)), SamplingParams(max_tokens=1))
    assert cache.allocate(a, 10)
    assert attn.req_blocks["a"] == [1, 2, 3] and rec.running_slot["a"] == 1  # outside every range; reserved slot
    cache._reserve(a, [8], None)  # a checkpoint after 8 tokens: the lowest free range is 1
    (pending,) = rec.pending
    assert pending.slot == plan.arena.first_overlay_slot + 1 == 3 and ov.held == {1}  # type: ignore[union-attr]
    assert all(attn.pool.ref_cnt[b] == 1 and b not in attn.req_blocks["a"] for b in range(K, 2 * K))
    assert attn.pool.num_plain == blocks - 1 - 3 - K
    cache.check_integrity()
    rec.drop_step_refs()  # the step failed: the slot is free again, so are its blocks
    assert ov.held == set() and attn.pool.num_plain == blocks - 1 - 3
    cache.check_integrity()


def test_a_checkpoint_evicts_the_cheapest_range_when_none_is_free() -> None:
    """Every block cached, no checkpoint to evict: a range with no referenced block gives its blocks up, and a block
    takes its cached descendants with it (a chain below a hole is unreachable)."""
    seqs, blocks = 1, 4 * K  # ids 1..15: ranges 1 (4..7), 2 (8..11), 3 (12..15)
    plan = plan_capacity(GROUPS, arena_budget(seqs, blocks), seqs, None, 64, 0, policy=CachePolicy())
    cache = HybridCacheManager(GROUPS, plan.layout())
    attn, rec, ov = cache.blocks[0], cache.states[0], cache.overlay
    assert ov is not None and cache.tree is not None
    x = Request("x", list(range(100, 160)), SamplingParams(max_tokens=1))  # 15 blocks: every one
    assert cache.allocate(x, 60)
    xb = list(attn.req_blocks["x"])
    assert xb[:3] == [1, 2, 3] and sorted(xb[3:7]) == [12, 13, 14, 15]  # outside ranges, then one range at a time
    attn.cache_full_blocks("x", x.block_hashes, 60)
    cache.free(x)  # all 15 cached, no checkpoint anywhere
    y = Request("y", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert cache.allocate(y, 5)  # two dead-end leaves go: x's last two blocks
    assert sorted(attn.req_blocks["y"]) == sorted(xb[-2:]) and ov.num_free_ranges == 0
    cache._reserve(y, [4], None)
    (pending,) = rec.pending
    assert ov.num_range_evictions == 1 and len(ov.held) == 1
    (c,) = ov.held
    assert pending.slot == plan.arena.first_overlay_slot + c  # type: ignore[union-attr]
    cut = min(i for i, b in enumerate(xb) if b in ov.blocks_of(c))
    assert attn.find_hit_tokens(x.block_hashes, 60) == cut * BS  # the chain ends where the range began
    assert all(attn.pool.lookup(h) is None for h in x.block_hashes[cut:])  # the range and everything below it
    cache.check_integrity()


# -- 3. random traces with a shadow of the shared memory ------------------------------------------------------------
class ArenaHarness(Harness):
    """test_cache_properties' harness on the arena: pools from the planner, shared memory in the shadow."""

    def __init__(self, trace: Trace) -> None:
        super().__init__(trace)
        need = max(r.max_blocks() for r in trace.reqs)
        budget = arena_budget(trace.max_num_seqs, 1 + need + trace.spare_blocks) + trace.spare_bytes
        policy = trace.cache_policy() or CachePolicy()
        self.plan = plan_capacity(GROUPS, budget, trace.max_num_seqs, trace.checkpoint_slots or None, 64,
                                  trace.interval, policy=policy)
        self.cache = HybridCacheManager(GROUPS, self.plan.layout(), enable_prefix_caching=trace.caching,
                                        tree_cls=trace.tree_cls, admission_cls=trace.admission_cls)
        self.sched = Scheduler(SchedulerConfig(trace.max_num_seqs, trace.budget), self.cache)
        assert self.plan.arena is not None
        self.arena: ArenaLayout = self.plan.arena

    def clobber_blocks_of(self, slot: int) -> None:
        for b in slot_blocks(self.arena, slot):
            self.shadow.attn[b] = ("clobbered by a checkpoint", ())

    def clobber_slot_over(self, block: int) -> None:
        c = block // K
        if c >= 1:
            self.shadow.state[self.arena.first_overlay_slot + c] = ("clobbered by a block", ())

    def simulate(self, out: SchedulerOutput) -> None:
        """Harness.simulate, with every write clobbering what shares its memory."""
        sh = self.shadow
        for src, dst in lead(out.group_state_copies):
            sh.state[dst] = sh.state[src]
            self.clobber_blocks_of(dst)
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            toks, salt = tuple(req.all_token_ids), req.cache_salt
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for i, b in enumerate(lead(s.group_block_ids)[: cdiv(start, BS)]):
                assert sh.attn.get(b) == (salt, toks[: min(start, (i + 1) * BS)]), (s.request_id, i, b)
            for i in range(start // BS, cdiv(end, BS)):
                sh.attn[lead(s.group_block_ids)[i]] = (salt, toks[: min(end, (i + 1) * BS)])
                self.clobber_slot_over(lead(s.group_block_ids)[i])
            if start > 0:
                assert sh.state.get(lead(s.group_state_slots, PAD_SLOT_ID)) == (salt, toks[:start]), s.request_id
            for b, slot in lead(s.group_checkpoints):
                sh.state[slot] = (salt, toks[:b])
                self.clobber_blocks_of(slot)
            sh.state[lead(s.group_state_slots, PAD_SLOT_ID)] = (salt, toks[:end])
            self.clobber_blocks_of(lead(s.group_state_slots, PAD_SLOT_ID))

    def check_holders(self) -> None:
        """Ref counts == holders (+ the arena's own), and no held checkpoint slot shares memory with a block that is
        held (in use or cached)."""
        attn, rec = self.cache.blocks[0], self.cache.states[0]
        holders = self.holders()
        assert set(attn.req_blocks) == set(holders) == set(rec.running_slot)
        held = Counter(b for rid in holders for b in attn.req_blocks[rid])
        for b in range(1, attn.pool.num_blocks):
            assert attn.pool.ref_cnt[b] == held[b] + own_refs(attn.pool, b), (b, held[b])
        slots = [rec.running_slot[rid] for rid in holders]
        assert len(set(slots)) == len(slots) and NULL_BLOCK_ID not in slots
        assert self.arena.first_overlay_slot not in slots  # pinned; a running slot past the reserved ones (leases
        # beyond max_num_seqs) is a checkpoint range's, and is checked below like a checkpoint
        assert rec.pending == [] and rec.step_refs == []
        pool = rec.pool
        for s in range(self.arena.first_overlay_slot + 1, pool.num_blocks):
            if pool.ref_cnt[s] or pool.block_hash[s] is not None:
                for b in slot_blocks(self.arena, s):
                    assert held[b] == 0 and attn.pool.block_hash[b] is None, (s, b, "overlaps a held block")
            assert pool.ref_cnt[s] == (s in slots), s  # between steps a checkpoint is cached or free

    def check_no_leak(self) -> None:
        assert not self.sched.requests
        for pool in self.cache.pools.values():
            pool.check_integrity()
            st_ = pool.stats()
            assert st_["in_use"] == 0, (pool.name, st_)
        assert self.cache.blocks[0].req_blocks == {} and self.cache.states[0].running_slot == {}


arena_traces = st.builds(
    Trace,
    kinds=st.just("hybrid"),
    interval=st.sampled_from([4, 8, 12]),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 24),
    checkpoint_slots=st.integers(0, 4),
    spare_blocks=st.integers(0, 3) | st.integers(0, 16),
    caching=st.sampled_from([True, True, True, False]),
    reqs=st.lists(req_specs, min_size=2, max_size=12).map(tuple),
    policy=st.sampled_from(["reuse-value", "reuse-value", "reuse-lru", "interval-value"]),
    spare_bytes=st.integers(0, 2000) | st.integers(0, 200),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arena_traces)
def test_random_traces_on_the_arena_keep_every_invariant(trace: Trace) -> None:
    ArenaHarness(trace).run()


def test_a_shared_prefix_workload_overlays_and_reuses_memory() -> None:
    """A deterministic trace where checkpoints land on blocks that held KV and blocks later reuse checkpoint memory."""
    reqs = tuple(ReqSpec(p, 24, tuple(range(i, i + 5)), 4, None, arrival=i, abort_at=None, prefill_only=False,
                         lease_steps=0) for i, p in enumerate([0, 0, 1, 1, 2, 0, 1, 2, 0, 0]))
    h = ArenaHarness(Trace("hybrid", 8, 1, 12, 0, 40, True, reqs, "reuse-value"))
    pool, ov = h.cache.blocks[0].pool, h.cache.overlay
    assert ov is not None
    seen = spy_overlay(pool, ov)
    h.run()
    assert seen["block_over_checkpoint"] > 0 and seen["checkpoint_over_block"] > 0, seen
    assert sum(r.num_cached_tokens for r in h.reqs.values()) > 0


# -- 4. tensors and transfers ---------------------------------------------------------------------------------------
def test_views_share_one_arena_and_a_checkpoint_write_lands_on_its_blocks() -> None:
    seqs, blocks = 2, 5 * K
    plan = plan_capacity(GROUPS, arena_budget(seqs, blocks), seqs, None, 64, 0, policy=CachePolicy())
    t = allocate_caches(GROUPS, plan, torch.device("cpu"))
    (kv,), (conv, ssm) = t[0], t[1]
    assert kv.shape[0] == blocks and conv.shape[0] == ssm.shape[0] == plan.state_slots
    assert {x.untyped_storage().data_ptr() for x in (kv, conv, ssm)} == {kv.untyped_storage().data_ptr()}
    assert all(x[0].is_contiguous() for x in (kv, conv, ssm))
    slot = plan.arena.first_overlay_slot + 2  # type: ignore[union-attr]
    ssm[slot] = 7.0
    under = kv[2 * K: 3 * K]
    assert under.abs().sum() > 0 and kv[: 2 * K].abs().sum() == 0 and kv[3 * K:].abs().sum() == 0
    ssm[1] = 3.0  # a running slot: reserved memory, no block under it
    assert kv[: 2 * K].abs().sum() == 0
    kv[2 * K: 3 * K] = 0
    assert ssm[slot].abs().sum() == 0 and conv[slot].abs().sum() == 0
    idx = torch.tensor([slot])
    ssm.index_copy_(0, torch.tensor([1]), ssm.index_select(0, idx))  # a restore through the strided view
    assert ssm[1].abs().sum() == 0


def test_transfer_layout_registers_the_arena_once_with_the_right_pages() -> None:
    from hybridpd.kvtransfer.agent import registration_spans
    from hybridpd.kvtransfer.layout import CacheLayout, GroupTensors

    seqs, blocks = 2, 5 * K
    plan = plan_capacity(GROUPS, arena_budget(seqs, blocks), seqs, None, 64, 0, policy=CachePolicy())
    t = allocate_caches(GROUPS, plan, torch.device("cpu"))
    layout = CacheLayout.from_tensors(
        [GroupTensors(0, "attention", [t[0][0]], (0, 3), stacked=True),
         GroupTensors(1, "gated_deltanet", [t[1]], (1, 2, 4), stacked=True)], model_id="m")
    spans = registration_spans(layout.regions)
    base = t[0][0].untyped_storage().data_ptr()
    assert len(spans) == 1 and spans[0][0] == base and spans[0][1] <= plan.physical_bytes
    kv_region, conv_region, ssm_region = layout.regions
    arena = plan.arena
    assert arena is not None
    assert kv_region.page_addr(5) == base + arena.attention_offset + 5 * B
    assert conv_region.page_addr(3) == t[1][0][3].data_ptr() == base + 3 * arena.slot_stride
    assert ssm_region.page_addr(3) == t[1][1][3].data_ptr() and not ssm_region.pages_contiguous
