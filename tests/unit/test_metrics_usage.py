"""`hybridpd_kv_cache_usage_ratio` means what vLLM's `kv_cache_usage` means: the share of a pool's pages that running
requests reference. Cached content (evictable) and the pages an arena lends to cached recurrent checkpoints count as
free, so an idle engine reads exactly 0 on every pool. The in-use count behind it (`BlockPool.stats`) is kept as
pages change state, not found by a scan of every page."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.metrics import WorkerMetrics
from prometheus_client import CollectorRegistry

from tests.unit.test_block_pool import H, tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CountingList(list[int]):
    """A ref-count list that counts reads by index (what a scan of every page does)."""

    reads = 0

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        CountingList.reads += 1
        return super().__getitem__(i)


def test_cached_pages_are_free_for_the_usage_figure() -> None:
    pool = tiny()  # 5 pages
    pages = pool.allocate(3)
    for b, h in zip(pages, H, strict=False):
        pool.cache(b, h)
    assert pool.usage() == 3 / 5
    pool.free(pages)
    assert pool.stats() == {"total": 5, "free": 2, "cached": 3, "in_use": 0}
    assert pool.usage() == 0.0  # cached: evictable, not in use
    pool.touch([pages[0]])  # a hit references one again
    assert pool.usage() == 1 / 5
    pool.check_integrity()


def test_a_drifted_in_use_count_fails_the_integrity_check() -> None:
    pool = tiny()
    pool.allocate(2)
    pool.check_integrity()
    pool.num_plain += 1  # a count that no longer matches the pages' ref counts
    with pytest.raises(AssertionError):
        pool.check_integrity()


def stats_reads(pools: list[BlockPool]) -> int:
    """Reads of ref counts that `stats()` of every pool does."""
    saved = [p.ref_cnt for p in pools]
    CountingList.reads = 0
    try:
        for p in pools:
            p.ref_cnt = CountingList(p.ref_cnt)
        for p in pools:
            p.stats()
        return CountingList.reads
    finally:
        for p, ref in zip(pools, saved, strict=True):
            p.ref_cnt = ref


def test_an_idle_hybrid_engine_reads_zero_usage_and_a_busy_one_what_it_holds() -> None:
    reg = CollectorRegistry()
    metrics = WorkerMetrics("decode", reg)
    core = LLM(kv_cache_memory_bytes=8 * 2**20, enable_prefix_caching=True).engine
    cache = core.cache
    assert cache.overlay is not None  # the arena: checkpoints overlay attention blocks

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
    assert stats["attention"]["cached"] and stats["attention"]["overlaid"], stats  # the arena lends pages
    assert stats["mamba2"]["cached"], stats  # cached checkpoints
    assert gauges() == dict.fromkeys(cache.labels.values(), 0.0)
    assert set(cache.usage().values()) == {0.0}
    cache.check_integrity()
    assert stats_reads(list(cache.pools.values())) == 0  # no scan of every page
