"""BlockPool on tiny pools: exact block ids, eviction order, ref counts, hash map, integrity after every scenario.

    fresh pool of 6:  null [0]   queue (front first): 1 2 3 4 5
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hybridpd.engine.cache.block_pool import BlockPool, PoolExhaustedError
from hybridpd.engine.cache.specs import NULL_BLOCK_ID

H = [bytes([i]) * 16 for i in range(16)]  # distinct fake block hashes


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    p = BlockPool(6, "tiny")
    yield p
    p.check_integrity()  # every scenario ends consistent


def test_fresh_pool_hands_out_ids_in_order(pool: BlockPool) -> None:
    assert pool.capacity == 5
    assert pool.num_free == 5
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_free == 0
    assert pool.stats() == {"total": 5, "free": 0, "cached": 0, "in_use": 5}
    assert pool.usage() == 1.0


def test_null_block_is_never_handed_out_nor_freed(pool: BlockPool) -> None:
    got = pool.allocate(5)
    assert NULL_BLOCK_ID not in got
    with pytest.raises(PoolExhaustedError, match="tiny: asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.free([NULL_BLOCK_ID, NULL_BLOCK_ID])  # ignored, not a double free
    pool.touch([NULL_BLOCK_ID])  # ignored
    assert pool.ref_cnt[NULL_BLOCK_ID] == 1
    assert pool.cache(NULL_BLOCK_ID, H[0]) is False
    assert pool.lookup(H[0]) is None
    pool.free(reversed(got))
    # after churn the null block is still never allocated
    assert sorted(pool.allocate(5)) == [1, 2, 3, 4, 5]
    pool.free(range(1, 6))


def test_failed_allocation_changes_nothing(pool: BlockPool) -> None:
    pool.allocate(4)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)
    assert pool.free_block_ids() == [5]
    assert pool.allocate(1) == [5]
    pool.free([1, 2, 3, 4, 5])


def test_freed_cached_blocks_go_to_the_back_uncached_to_the_front(pool: BlockPool) -> None:
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.cache(1, H[1])
    pool.free([1])  # cached: back of the queue, evicted last
    assert pool.free_block_ids() == [4, 5, 1]
    pool.free([2])  # no hash: front, reused before any cached block is evicted
    assert pool.free_block_ids() == [2, 4, 5, 1]
    assert pool.allocate(3) == [2, 4, 5]
    assert pool.lookup(H[1]) == 1 and pool.num_evictions == 0
    assert pool.allocate(1) == [1]  # only now is cached content evicted
    assert pool.lookup(H[1]) is None and pool.num_evictions == 1
    pool.free([3, 2, 4, 5, 1])
    assert pool.free_block_ids() == [1, 5, 4, 2, 3]


def test_tail_first_freeing_evicts_tails_first(pool: BlockPool) -> None:
    req = pool.allocate(3)  # a request's table [1, 2, 3]
    for b, h in zip(req, H[:3], strict=True):
        assert pool.cache(b, h)
    pool.free(reversed(req))  # the convention: tail first
    assert pool.free_block_ids() == [4, 5, 3, 2, 1]
    # uncached blocks 4, 5 go first, then the tail 3, then 2; the prefix head 1 survives longest
    assert pool.allocate(3) == [4, 5, 3]
    assert pool.lookup(H[2]) is None  # 3's hash dropped on eviction
    assert pool.lookup(H[0]) == 1 and pool.lookup(H[1]) == 2
    assert pool.num_evictions == 1
    pool.free([4, 5, 3])


def test_touch_reuses_a_cached_block_and_takes_it_out_of_the_queue(pool: BlockPool) -> None:
    b1, b2 = pool.allocate(2)
    assert pool.cache(b1, H[1]) and pool.cache(b2, H[2])
    pool.free([b2, b1])
    assert pool.stats() == {"total": 5, "free": 3, "cached": 2, "in_use": 0}
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]

    hit = pool.lookup(H[1])
    assert hit == 1
    pool.touch([hit])
    assert pool.ref_cnt[1] == 1
    assert pool.free_block_ids() == [3, 4, 5, 2]
    assert pool.lookup(H[1]) == 1  # still cached while in use
    assert pool.stats() == {"total": 5, "free": 3, "cached": 1, "in_use": 1}

    pool.touch([1])  # a second holder
    assert pool.ref_cnt[1] == 2
    pool.free([1])
    assert pool.ref_cnt[1] == 1 and 1 not in pool.free_block_ids()
    pool.free([1])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    assert pool.num_evictions == 0


def test_allocation_evicts_oldest_cached_first_and_drops_its_hash(pool: BlockPool) -> None:
    blocks = pool.allocate(5)
    for b, h in zip(blocks, H[1:6], strict=True):
        pool.cache(b, h)
    pool.free([2])
    pool.free([4])
    pool.free([1])
    assert pool.free_block_ids() == [2, 4, 1]
    assert pool.allocate(1) == [2]
    assert pool.lookup(H[2]) is None and pool.block_hash[2] is None
    assert pool.num_evictions == 1
    assert pool.allocate(1) == [4]
    assert pool.lookup(H[4]) is None
    assert pool.lookup(H[1]) == 1  # not evicted yet
    assert pool.lookup(H[3]) == 3 and pool.lookup(H[5]) == 5  # in use: never evicted
    assert pool.num_evictions == 2
    assert pool.stats() == {"total": 5, "free": 0, "cached": 1, "in_use": 4}
    pool.free([2, 3, 4, 5])


def test_double_free_raises(pool: BlockPool) -> None:
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="tiny: double free of block 1"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="double free of block 4"):
        pool.free([4])  # never allocated
    assert pool.ref_cnt[1] == 0 and pool.ref_cnt[4] == 0


def test_cache_refuses_duplicates_and_renames(pool: BlockPool) -> None:
    a, b = pool.allocate(2)
    assert pool.cache(a, H[7]) is True
    assert pool.cache(b, H[7]) is False  # same content already held by a
    assert pool.cache(a, H[8]) is False  # a is already named
    assert pool.lookup(H[7]) == a and pool.block_hash[b] is None
    pool.uncache(a)
    assert pool.lookup(H[7]) is None and pool.num_evictions == 0
    assert pool.cache(b, H[7]) is True
    pool.free([b, a])
    assert pool.stats() == {"total": 5, "free": 4, "cached": 1, "in_use": 0}


def test_pool_needs_a_real_block() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, "x")
    p = BlockPool(2)
    assert p.allocate(1) == [1]
    p.free([1])
    p.check_integrity()


def test_check_integrity_catches_corruption(pool: BlockPool) -> None:
    pool.allocate(1)
    pool.ref_cnt[1] = 0  # block 1 unreferenced but not in the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool.ref_cnt[1] = 1
    pool.cached[H[3]] = 2  # a hash map entry without the block's name
    with pytest.raises(AssertionError):
        pool.check_integrity()
    del pool.cached[H[3]]
    pool.free([1])
