"""`hybridpd_kv_cache_usage_ratio` means what vLLM's `kv_cache_usage` means: the share of a group's ids (pages for
attention, state slots for recurrent groups) that running requests hold. Cached content (evictable blocks, and the
pages cached recurrent checkpoints take) counts as free, so an idle engine reads exactly 0 on every group. The
in-use count behind it (`HybridCacheManager.num_in_use`) is kept as pages change state, not found by a scan of every
page."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec
from hybridpd.engine.metrics import WorkerMetrics
from hybridpd.engine.request import Request
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")


def tiny() -> HybridCacheManager:
    """An attention-only cache of 5 usable pages."""
    return HybridCacheManager([CacheGroup(0, ATTN, (0,))], PoolLayout(6, 0, 0, BS))


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


class CountingList(list[int]):
    """A ref-count list that counts reads by index (what a scan of every page does)."""

    reads = 0

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        CountingList.reads += 1
        return super().__getitem__(i)


def test_cached_pages_are_free_for_the_usage_figure() -> None:
    cache = tiny()
    a = request("a", list(range(12)))
    assert cache.allocate(a, 12)  # 3 pages
    assert cache.usage() == {"attention": 3 / 5}
    a.num_computed_tokens = 12
    cache.on_step_done([a])  # the 3 blocks are named: cached once a lets go
    cache.free(a)
    (stats,) = cache.pool_stats()
    assert stats == {"group_id": 0, "kind": "attention", "total": 5, "free": 2, "cached": 3, "in_use": 0}
    assert cache.usage() == {"attention": 0.0}  # cached: evictable, not in use
    b = request("b", list(range(4)) + [50, 51])
    hit = cache.find_prefix_hit(b)
    assert hit.blocks == (1,)
    assert cache.allocate(b, 4, hit)  # a hit references one cached page again
    assert cache.usage() == {"attention": 1 / 5}
    assert cache.pool_stats()[0]["cached"] == 2
    cache.check_integrity()


def test_a_drifted_in_use_count_fails_the_integrity_check() -> None:
    cache = tiny()
    assert cache.allocate(request("a", list(range(8))), 8)
    cache.check_integrity()
    cache.num_in_use += 1  # a count that no longer matches the pages the requests hold
    with pytest.raises(AssertionError):
        cache.check_integrity()


def stats_reads(cache: HybridCacheManager) -> int:
    """Reads of page reference counts that `pool_stats()` and `usage()` do."""
    saved = cache.pages.ref
    CountingList.reads = 0
    try:
        cache.pages.ref = CountingList(saved)
        cache.pool_stats()
        cache.usage()
        return CountingList.reads
    finally:
        cache.pages.ref = saved


def test_an_idle_hybrid_engine_reads_zero_usage_and_a_busy_one_what_it_holds() -> None:
    reg = CollectorRegistry()
    metrics = WorkerMetrics("decode", reg)
    core = LLM(kv_cache_memory_bytes=8 * 2**20, enable_prefix_caching=True).engine
    cache = core.cache
    assert cache.has_blocks and cache.has_states and core.plan.blocks_per_checkpoint >= 1  # one arena, both kinds

    def gauges() -> dict[str, float | None]:
        return {
            kind: reg.get_sample_value("hybridpd_kv_cache_usage_ratio", {"role": "decode", "group": kind})
            for kind in cache.labels.values()
        }

    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    shared = list(range(3, 73))  # a shared prefix: cached blocks and recurrent checkpoints
    for i in range(3):
        core.add_request(f"r{i}", shared + [100 + i] * (10 + i), sp)
    core.step()
    metrics.update(core)
    busy = gauges()
    assert all(u is not None and u > 0 for u in busy.values()), busy
    for kind, u in cache.usage().items():  # what it holds: the running requests' pages
        s = next(p for p in cache.pool_stats() if p["kind"] == kind.split(":")[0])
        assert u == s["in_use"] / s["total"], (kind, u, s)  # type: ignore[operator]
    while core.has_unfinished():
        core.step()
    metrics.update(core)
    stats = {s["kind"]: s for s in cache.pool_stats()}
    ckpt_pages = cache.pages.num_checkpoint_pages
    assert stats["mamba2"]["cached"] == cache.tree.num_checkpoints > 0, stats  # cached checkpoints
    assert ckpt_pages == cache.tree.num_checkpoints * core.plan.blocks_per_checkpoint
    # the attention group's cached pages: cached blocks and the pages the checkpoints take, both evictable
    assert stats["attention"]["cached"] > ckpt_pages > 0, stats
    assert stats["attention"]["in_use"] == stats["mamba2"]["in_use"] == 0, stats
    assert gauges() == dict.fromkeys(cache.labels.values(), 0.0)
    assert set(cache.usage().values()) == {0.0}
    cache.check_integrity()
    assert stats_reads(cache) == 0  # no scan of every page
