"""BlockPool on tiny pools: exact block ids, free order, ref counts, hash map, what its listener (the cache tree)
hears, integrity after every scenario.

    fresh pool of 6:  null [0]   free (next first): 1 2 3 4 5
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hybridpd.engine.cache.block_pool import BlockPool, PoolExhaustedError
from hybridpd.engine.cache.specs import NULL_BLOCK_ID

from tests.support.pool_views import free_order

H = [bytes([i]) * 16 for i in range(16)]  # distinct fake block hashes


class Heard:
    """A stand-in for the cache tree: records what the pool tells it."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def on_release(self, pool: BlockPool, block_id: int) -> None:
        self.log.append(("release", block_id))

    def on_acquire(self, pool: BlockPool, block_id: int) -> None:
        self.log.append(("acquire", block_id))


def tiny(num_blocks: int = 6, name: str = "tiny") -> BlockPool:
    p = BlockPool(num_blocks, name)
    p.listener = Heard()
    return p


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    p = tiny()
    yield p
    p.check_integrity()  # every scenario ends consistent


def test_fresh_pool_hands_out_ids_in_order(pool: BlockPool) -> None:
    assert pool.capacity == 5
    assert pool.num_free == 5
    assert free_order(pool) == [1, 2, 3, 4, 5]
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
    assert free_order(pool) == [5]
    assert pool.allocate(1) == [5]
    pool.free([1, 2, 3, 4, 5])


def test_allocation_takes_free_blocks_only_and_never_evicts(pool: BlockPool) -> None:
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.cache(1, H[1])
    pool.free([1])  # cached: the tree hears it is evictable; it is not free
    assert pool.listener.log == [("release", 1)]  # type: ignore[attr-defined]
    assert free_order(pool) == [4, 5, 1] and pool.num_plain == 2
    pool.free([2])  # no hash: free, handed out next
    assert free_order(pool) == [2, 4, 5, 1]
    assert pool.allocate(3) == [2, 4, 5]
    with pytest.raises(PoolExhaustedError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)  # only the tree evicts
    assert pool.lookup(H[1]) == 1 and pool.num_evictions == 0
    pool.evict(1)
    assert pool.lookup(H[1]) is None and pool.num_evictions == 1
    assert pool.allocate(1) == [1]
    pool.free([3, 2, 4, 5, 1])
    assert free_order(pool) == [1, 5, 4, 2, 3]


def test_released_in_order_evicted_pages_free_first(pool: BlockPool) -> None:
    req = pool.allocate(3)  # a request's table [1, 2, 3]
    for b, h in zip(req, H[:3], strict=True):
        assert pool.cache(b, h)
    pool.free(reversed(req))  # the convention: tail first
    assert pool.listener.log == [("release", 3), ("release", 2), ("release", 1)]  # type: ignore[attr-defined]
    assert free_order(pool) == [4, 5, 3, 2, 1]
    pool.evict(3)  # an evicted page is the next one handed out
    assert free_order(pool) == [3, 4, 5, 2, 1]
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.lookup(H[2]) is None and pool.lookup(H[0]) == 1 and pool.lookup(H[1]) == 2
    pool.free([4, 5, 3])


def test_touch_reuses_a_cached_block_and_takes_it_out_of_the_queue(pool: BlockPool) -> None:
    b1, b2 = pool.allocate(2)
    assert pool.cache(b1, H[1]) and pool.cache(b2, H[2])
    pool.free([b2, b1])
    assert pool.stats() == {"total": 5, "free": 3, "cached": 2, "in_use": 0}
    assert free_order(pool) == [3, 4, 5, 2, 1]

    hit = pool.lookup(H[1])
    assert hit == 1
    pool.touch([hit])
    assert pool.ref_cnt[1] == 1 and pool.listener.log[-1] == ("acquire", 1)  # type: ignore[attr-defined]
    assert free_order(pool) == [3, 4, 5, 2]
    assert pool.lookup(H[1]) == 1  # still cached while in use
    assert pool.stats() == {"total": 5, "free": 3, "cached": 1, "in_use": 1}

    pool.touch([1])  # a second holder
    assert pool.ref_cnt[1] == 2
    pool.free([1])
    assert pool.ref_cnt[1] == 1 and 1 not in free_order(pool)
    pool.free([1])
    assert free_order(pool) == [3, 4, 5, 2, 1]
    assert pool.num_evictions == 0


def test_rename_moves_a_name_to_the_live_copy(pool: BlockPool) -> None:
    old, live = pool.allocate(2)
    assert pool.cache(old, H[4])
    pool.free([old])
    pool.rename(old, live)  # a request recomputed H[4] into `live`: it takes the name, `old` is free
    assert pool.lookup(H[4]) == live and pool.block_hash[old] is None
    assert free_order(pool)[0] == old and pool.num_evictions == 0
    pool.free([live])
    assert pool.stats() == {"total": 5, "free": 4, "cached": 1, "in_use": 0}


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
    pool.evict(a, count=False)
    assert pool.lookup(H[7]) is None and pool.num_evictions == 0
    assert pool.cache(b, H[7]) is True
    pool.free([b, a])
    assert pool.stats() == {"total": 5, "free": 4, "cached": 1, "in_use": 0}


def test_pool_needs_a_real_block() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, "x")
    p = tiny(2, "x")
    assert p.allocate(1) == [1]
    p.free([1])
    p.check_integrity()


def test_check_integrity_catches_corruption(pool: BlockPool) -> None:
    pool.allocate(1)
    pool.ref_cnt[1] = 0  # block 1 unreferenced but neither free nor cached
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool.ref_cnt[1] = 1
    pool.cached[H[3]] = 2  # a hash map entry without the block's name
    with pytest.raises(AssertionError):
        pool.check_integrity()
    del pool.cached[H[3]]
    pool.free([1])
