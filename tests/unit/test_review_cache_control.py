"""Review of the cache control plane (engine/cache): invariants `check_integrity` did not state, each broken on
purpose here (a state no correct run reaches) and caught. HybridCacheManager driven directly (no model), an
attention group (block size 4) and a Mamba-2 group; reuse admission."""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.coordinator import HybridCacheManager, PendingCheckpoint, PoolLayout
from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.cache.tree import BLOCK
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler

from benchmarks.cache_policies import IntervalAdmission, LruTree
from tests.support.pool_views import page_bytes

BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")
GROUPS = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))]
K = -(-page_bytes([GROUPS[1]]) // page_bytes([GROUPS[0]]))


def make(num_pages: int = 40, max_checkpoints: int | None = None) -> HybridCacheManager:
    layout = PoolLayout(num_pages, 1 + 2 + STAGING_SLOTS, 0, BS, K, max_checkpoints=max_checkpoints)
    return HybridCacheManager(GROUPS, layout)


def req(rid: str, base: int, n: int = 12) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=4))


def cached_block(cache: HybridCacheManager) -> tuple[HybridCacheManager, int]:
    """A request computed 12 tokens (3 blocks named) and ended: its blocks are cached, unreferenced."""
    r = req("a", 100)
    assert cache.allocate(r, 12)
    r.num_computed_tokens = 12
    cache.on_step_done([r])
    cache.free(r)
    cache.check_integrity()
    page = next(n.page for n in cache.tree.nodes.values() if n.page and not n.kids)
    return cache, page


def test_a_slot_held_twice_is_caught() -> None:
    """A staging slot that is also a request's running slot (two writers of one state) passed: slots were compared
    as sets."""
    cache = make()
    assert cache.allocate(req("a", 100), 4)
    cache.check_integrity()
    cache.staging.append(cache.running_slot["a"])
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_named_block_referenced_by_nobody_listed_is_caught() -> None:
    """A cached block with a reference no request holds (never evictable again: a leak) passed: a page referenced
    once with no holder was taken for a checkpoint's page."""
    cache, page = cached_block(make())
    cache.tree._dequeue(BLOCK, cache.tree.page_node[page])  # (as a leaked reference leaves it: not a leaf)
    cache.pages.ref[page] = 1
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_stale_page_to_node_entry_is_caught() -> None:
    """`page_node[p]` naming a node that holds another page (freeing p would release that node) passed."""
    cache, page = cached_block(make())
    free = cache.pages.free[-1]
    cache.tree.page_node[free] = cache.tree.page_node[page]
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_stale_checkpoint_index_entry_is_caught() -> None:
    """`ckpt_node` (an export's pin and unpin find a checkpoint by its first page) pointing at a free page passed."""
    cache = make()
    r = req("a", 100)
    ckpt = cache.reserve_checkpoint(r, 4)
    assert ckpt is not None
    cache.publish_checkpoint(ckpt)
    cache.check_integrity()
    node = cache.tree.ckpt_node[ckpt.pages[0]]
    cache.tree.ckpt_node[cache.pages.free[-1]] = node
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_pending_checkpoint_on_a_cached_ones_pages_is_caught() -> None:
    """A checkpoint to be written into pages a cached checkpoint holds (publishing it overwrites that one) passed:
    their pages are referenced once either way."""
    cache = make()
    r = req("a", 100)
    ckpt = cache.reserve_checkpoint(r, 4)
    assert ckpt is not None
    cache.publish_checkpoint(ckpt)
    cache.tree.num_reserved += 1
    cache.pending.append(PendingCheckpoint("b", 8, ckpt.pages, r.block_hashes[1]))
    with pytest.raises(AssertionError):
        cache.check_integrity()


@pytest.mark.parametrize("reserved", [-1, 2])
def test_reserved_checkpoint_accounting_is_checked(reserved: int) -> None:
    """`tree.num_reserved` below zero, or the cached plus the reserved checkpoints over `max_checkpoints`, passed."""
    cache = make(max_checkpoints=2)
    ckpt = cache.reserve_checkpoint(req("a", 100), 4)
    assert ckpt is not None
    cache.publish_checkpoint(ckpt)
    cache.check_integrity()
    cache.tree.num_reserved = reserved
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_transfers_checkpoint_pages_are_not_zeroed_as_a_freed_requests_fresh_blocks() -> None:
    """A step launched ahead that cannot cover every row is not launched (`schedule_ahead` returns None) but the
    pages it added stay with their requests, listed as fresh (to be zeroed before the next step). A request that
    ends frees such a page; a transfer then reserves it for the checkpoint it pulls (a decode worker: asynchronous
    scheduling and pulled checkpoints). The next step's fresh blocks must not list it: zeroing that page wipes the
    pulled checkpoint (a page is block j of every attention group, or one k-th of a checkpoint)."""
    cache = make(num_pages=1 + 4 + 1)  # A and B hold 2 blocks each, one page free
    sched = Scheduler(SchedulerConfig(2, 64), cache)
    a, b = req("a", 100, 7), req("b", 200, 7)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {s.request_id: (1, 0.0) for s in out.seqs})  # both at 8 tokens, 2 blocks each
    assert len(cache.pages.free) == 1
    assert sched.schedule_ahead([(a, 8), (b, 8)]) is None  # A got the last page (fresh), B could not
    sched.finish(a, "stop")  # A ends before the step that would have written its new page
    d = req("d", 100, 8)  # a consumer's transfer: A's prefix, its checkpoint after 4 tokens pulled
    ckpt = cache.reserve_checkpoint(d, 4)
    assert ckpt is not None
    out = sched.schedule()
    zeroed = set(lead(out.group_fresh_blocks))
    assert not zeroed & set(ckpt.pages), (zeroed, ckpt.pages)
    cache.check_integrity()


def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    return pairs[0][1] if pairs else empty


def test_a_cut_chunk_leaves_no_stale_targets_under_interval_admission() -> None:
    """The vLLM-style baseline (benchmarks/cache_policies.py: IntervalAdmission, LruTree) derives its boundaries
    from each chunk and keeps no targets. A chunk cut at a checkpoint that found no staging slot used to queue the
    boundaries past the cut as targets anyway; nothing ever took them off, so `checkpoint_kind` answered "planned"
    for every later step of the request (asynchronous scheduling never ran ahead for it again). The boundaries past
    the cut are still saved by the next chunk."""
    layout = PoolLayout(60, 1 + 1 + STAGING_SLOTS, 8, BS, K, policy=CachePolicy(8))
    cache = HybridCacheManager(GROUPS, layout, tree_cls=LruTree, admission_cls=IntervalAdmission)
    sched = Scheduler(SchedulerConfig(1, 64), cache)
    a = req("a", 100, 40)
    sched.add_request(a)
    out = sched.schedule()  # (0, 40]: 8 and 16 in the two staging slots, cut at 24 (saved from the running slot)
    (s,) = out.seqs
    assert s.num_new_tokens == 24 and not s.sample and len(out.state_saves) == 3
    sched.update_from_output(out, {})
    out = sched.schedule()  # (24, 40]: 32 inside, 40 at its end
    assert out.seqs[0].num_new_tokens == 16 and len(out.state_saves) == 2
    sched.update_from_output(out, {"a": (1, 0.0)})
    assert cache.checkpoint_kind(a, 41, 40) is None  # (40, 41] holds no boundary
    assert cache.tree.num_checkpoints == 5
    cache.check_integrity()
