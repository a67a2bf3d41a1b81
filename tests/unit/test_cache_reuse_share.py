"""The speculative-checkpoint rule of the range-free experiment (benchmarks/cache_range_free.py): the reuse rate
counts reused and unreused boundaries, kept or not, never superseded ones; past the share a new speculative
checkpoint replaces the lowest checkpoint, or is skipped when that one served a hit lately; the doorkeeper; the
share's bookkeeping stays equal to the tree's heap.

    prompt P + [x]:  3 full blocks (block 4 tokens), a prompt-end checkpoint at 12 (speculative)
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.coordinator import PoolLayout
from hybridpd.engine.cache.tree import STATE as STATE_ITEM
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.scheduler import Scheduler

from benchmarks.cache_range_free import CONTINUATION, FRESH, ShareCacheManager, SpeculativeShare
from tests.unit.test_cache_v2 import BS, GROUPS, P, make, serve


def make_share(budget: int = 4000) -> Scheduler:
    layout = PoolLayout(64, 16, 0, BS, budget, CachePolicy())
    return Scheduler(SchedulerConfig(2, 64), ShareCacheManager(GROUPS, layout))


def share_of(s: Scheduler) -> SpeculativeShare:
    return s.cache.share  # type: ignore[attr-defined, no-any-return]


def distinct(i: int) -> list[int]:
    return list(range(1000 + 20 * i, 1013 + 20 * i))  # 13 tokens: a speculative checkpoint at 12


def check_share(s: Scheduler) -> None:
    tree, share = s.cache.tree, share_of(s)
    names = tree.state.block_hash  # type: ignore[union-attr]
    assert set().union(*share.idle) == {b for b in tree.queued[STATE_ITEM] if names[b] in share.cached}
    assert all(share.class_of[names[b]] == c for c, idle in enumerate(share.idle) for b in idle)
    assert share.cached <= tree.state.cached.keys()  # type: ignore[union-attr]


def test_reuse_rates_count_reused_and_unreused_boundaries_per_class_never_superseded_ones() -> None:
    share = SpeculativeShare(window=3)
    assert share.reuse_rate(FRESH) == share.reuse_rate(CONTINUATION) == 0.5  # no evidence yet
    share.on_request("a", [b"p0"])  # nothing watched in its prompt: fresh
    share.watch("a", b"a12")
    share.watch("a", b"a16")  # the same request's deeper boundary supersedes a12: neither hit nor miss
    share.watch("b", b"b12")
    share.watch("c", b"c12")
    assert list(share.watched) == [b"a16", b"b12", b"c12"] and share.num_missed == [0, 0]
    share.on_request("a2", [b"x", b"a12", b"a16"])  # a next turn of a: a16 reused (a12 left unscored)
    share.on_request("a3", [b"a16"])  # counted once; a3 continues nothing watched: fresh
    assert share.num_reused == [1, 0] and share.request_class == {"a": FRESH, "a2": CONTINUATION, "a3": FRESH}
    share.watch("a2", b"a2_40")  # a continuation's boundary
    share.watch("e", b"e12")  # past the window: b12, the oldest, leaves unreused
    assert share.num_missed == [1, 0] and share.num_watched == [2, 1]
    assert share.watched == {b"c12": FRESH, b"a2_40": CONTINUATION, b"e12": FRESH}
    share.num_reused[FRESH], share.num_missed[FRESH], share._rate[FRESH] = 8, 0, 1.0
    assert share.reuse_rate(FRESH) == 0.9  # both watched fresh ones are young enough for a share of 1.0
    share._rate[FRESH] = 0.34  # a share that keeps one: the other watched one is stale (a provisional miss)
    assert share.reuse_rate(FRESH) == 9 / 11
    assert share.reuse_rate(CONTINUATION) == 0.5


def test_past_the_share_a_new_speculative_checkpoint_replaces_the_lowest() -> None:
    plain, capped = make(budget=4000), make_share(budget=4000)
    share_of(capped).num_missed[FRESH] = 8  # p about 1/10: 400 bytes, two idle states
    for s in (plain, capped):
        for i in range(4):
            serve(s, f"r{i}", distinct(i))
            if s is capped:
                check_share(s)
    assert len(plain.cache.recurrent.pool.cached) == 4  # type: ignore[union-attr]
    assert len(capped.cache.recurrent.pool.cached) == 2 and len(share_of(capped).idle[FRESH]) == 2  # type: ignore[union-attr]
    assert capped.cache.recurrent.pool.num_evictions == 2  # type: ignore[union-attr]  # the two oldest went


def test_a_checkpoint_that_served_lately_stays_and_the_newcomer_is_skipped() -> None:
    s = make_share()
    a, _ = serve(s, "a", P + [1])
    b, _ = serve(s, "b", P + [2])
    assert b.num_cached_tokens == 12 and share_of(s).num_reused == [1, 0]
    share_of(s).num_missed[FRESH] = 198  # p = 2/200: no room for another idle one
    skipped = s.cache.tree.num_checkpoints_skipped
    c, _ = serve(s, "c", distinct(0))
    state = s.cache.recurrent.pool  # type: ignore[union-attr]
    assert state.lookup(a.block_hashes[2]) is not None and state.lookup(c.block_hashes[2]) is None
    assert s.cache.tree.num_checkpoints_skipped > skipped
    check_share(s)


def test_a_turn_supersedes_its_own_boundaries_and_the_next_turn_reuses_the_last() -> None:
    s = make_share()
    share = share_of(s)
    r, _ = serve(s, "a", P + [1], max_tokens=10)  # prompt end 12, then rolling request ends 16, 20 (replacing)
    state = s.cache.recurrent.pool  # type: ignore[union-attr]
    assert list(share.watched) == [r.block_hashes[4]] and share.num_missed == [0, 0]
    assert share.cached == {r.block_hashes[4]}  # the last rolling one, 20 tokens: what a next turn would hit
    assert state.lookup(r.block_hashes[2]) is not None  # the prompt end, superseded (demoted): not counted
    check_share(s)
    turn, _ = serve(s, "a2", r.all_token_ids + [5, 6, 7, 8, 9])
    assert turn.num_cached_tokens == 20 and share.num_reused == [1, 0]
    assert share.watched == {turn.block_hashes[6]: CONTINUATION}  # a continuation's boundary


def test_each_class_has_its_own_share() -> None:
    """Fresh requests' boundaries went unreused (their share is near 0): a fresh checkpoint must replace the
    lowest one; a continuation (its prompt holds a watched boundary) keeps its own beside it."""
    cont, fresh = make_share(), make_share()
    for s in (cont, fresh):
        a, _ = serve(s, "a", P + [1])
        share_of(s).num_missed[FRESH] = 998
    a2, _ = serve(cont, "a2", a.all_token_ids + [5, 6, 7, 8, 9])  # a's next turn: checkpoint at its prompt end 16
    d, _ = serve(fresh, "d", distinct(0))  # fresh, over its share: replaces a's checkpoint (unserved: it may go)
    state = cont.cache.recurrent.pool  # type: ignore[union-attr]
    assert a2.num_cached_tokens == 12 and state.lookup(a2.block_hashes[3]) is not None
    assert state.lookup(a.block_hashes[2]) is not None and share_of(cont).num_reused == [1, 0]
    assert share_of(cont).idle[CONTINUATION] and share_of(cont).idle[FRESH]
    state = fresh.cache.recurrent.pool  # type: ignore[union-attr]
    assert state.lookup(d.block_hashes[2]) is not None and state.lookup(a.block_hashes[2]) is None
    for s in (cont, fresh):
        check_share(s)


def test_the_doorkeeper_keeps_items_with_credit_left() -> None:
    """A speculative checkpoint's room may not evict an item whose priority is above the clock (the plain room
    does): asked for a state and 55 blocks after `a`, it is skipped and `a`'s cache stays."""
    plain, door = make(budget=4000), make_share(budget=4000)
    share_of(door).num_reused[FRESH] = 1000  # p near 1: the share does not bind
    for s in (plain, door):
        a, _ = serve(s, "a", P + [1])
    tree, state = door.cache.tree, door.cache.recurrent.pool  # type: ignore[union-attr]
    needs = [(state, 1), (door.cache.attention.pool, 55)]  # type: ignore[union-attr]
    assert tree._lowest()[2] > tree.clock  # type: ignore[index]  # every queued item has credit left
    assert not tree.speculative_room("x", needs)  # type: ignore[attr-defined]
    assert tree.num_checkpoints_skipped == 1 and state.lookup(a.block_hashes[2]) is not None
    check_share(door)
    plain_needs = [(plain.cache.recurrent.pool, 1), (plain.cache.attention.pool, 55)]  # type: ignore[union-attr]
    assert plain.cache.tree.make_room(plain_needs, checkpoint=True)  # the plain room evicts a's cache


def test_the_arena_has_no_share() -> None:
    from hybridpd.engine.cache.planner import plan_capacity

    plan = plan_capacity(GROUPS, 1 << 20, 2, None, 64, 0, policy=CachePolicy())
    with pytest.raises(AssertionError):
        ShareCacheManager(GROUPS, plan.layout())
