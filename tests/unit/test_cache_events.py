"""Contract: a cache's events replay to exactly its `cached_hashes()`, and a router index built from them predicts
exactly the hit the worker's own `find_prefix_hit` returns (and `find_transfer_hit` for pulls).

Real engine runs (random tiny checkpoints of both families, fp32 on CPU) with shared prefixes of odd lengths and a
cache small enough to evict: the replay covers stored and removed events of every group, attention and recurrent.
Any cache implementation (the coordinator's pools, a radix tree) must keep this test green.
"""

from __future__ import annotations

import random

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.events import CacheEventLog
from hybridpd.proxy.cache_index import CacheShape, WorkerCacheIndex, prompt_block_hashes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def cache_shape(cache: HybridCacheManager) -> CacheShape:
    return CacheShape(
        block_size=cache.block_size,
        attention_groups=tuple(cache.attention_groups),
        recurrent_groups=tuple(cache.recurrent_groups),
        align=cache.align if cache.recurrent_groups else cache.block_size,
    )


def replay(index: WorkerCacheIndex, log: CacheEventLog) -> set[int]:
    """Apply the drained events; returns the groups that had a removed event."""
    _, events, lost = log.drain_from()
    assert not lost
    index.apply(index.seq, [(e.stored, e.group, e.block_hash) for e in events])
    return {e.group for e in events if not e.stored}


def workload(seed: int) -> list[list[int]]:
    """Prefixes of odd lengths, each reused a few times with different tails, interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in (37, 70, 101, 53, 86)]
    prompts = [p + [rng.randrange(256) for _ in range(rng.randrange(3, 30))] for p in prefixes for _ in range(3)]
    rng.shuffle(prompts)
    return prompts


def real_hit(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[int, int]:
    core = llm.engine
    req = core.new_request("probe", prompt, GREEDY, salt)
    prefix = core.cache.find_prefix_hit(req, count=False).num_tokens
    transfer = core.cache.find_transfer_hit(req, len(prompt) - 1).num_tokens
    return prefix, transfer


@pytest.mark.parametrize("name", ["nemotron_attn_last", "qwen_attn_first"])
def test_events_replay_to_the_snapshot_and_predict_the_hit(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    llm = LLM(
        model=checkpoint_dir(name),
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=2**19,
        max_num_seqs=4,
        max_model_len=256,
    )
    cache = llm.engine.cache
    shape = cache_shape(cache)
    assert shape.attention_groups and shape.recurrent_groups
    index = WorkerCacheIndex(shape)
    index.load_snapshot("e", cache.events.seq, cache.cached_hashes())
    prompts = workload(seed=3)
    predicted_hits, removed = 0, set()
    for i, prompt in enumerate(prompts):
        hashes = prompt_block_hashes(prompt, shape.block_size)
        expect, expect_transfer = real_hit(llm, prompt)
        assert index.usable_hit(hashes, len(prompt)) == expect, (i, len(prompt))
        assert index.transfer_hit(hashes, len(prompt) - 1) == expect_transfer, (i, len(prompt))
        predicted_hits += expect
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        assert out.num_cached_tokens == expect
        removed |= replay(index, cache.events)
        assert index.groups == cache.cached_hashes(), i
        cache.check_integrity()
    assert predicted_hits > 0  # the workload reuses prefixes: hits happened and were predicted
    assert removed == {g.group_id for g in cache.groups}, (
        f"only groups {removed} evicted: the replay did not cover removed events")


def test_salted_prompts_hash_apart(checkpoint_dir):  # type: ignore[no-untyped-def]
    llm = LLM(model=checkpoint_dir("nemotron_attn_mid"), kv_cache_memory_bytes=8 * 2**20, max_model_len=256)
    cache = llm.engine.cache
    index = WorkerCacheIndex(cache_shape(cache))
    index.load_snapshot("e", cache.events.seq, cache.cached_hashes())
    prompt = workload(seed=5)[0] + list(range(40))
    llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
    replay(index, cache.events)
    for salt in ("", "tenant-a"):
        hashes = prompt_block_hashes(prompt, cache.block_size, salt)
        assert index.usable_hit(hashes, len(prompt)) == real_hit(llm, prompt, salt or None)[0]
    assert index.usable_hit(prompt_block_hashes(prompt, cache.block_size, ""), len(prompt)) > 0


def test_event_log_overflow_and_gaps_mark_the_index_stale() -> None:
    log = CacheEventLog(capacity=2)
    for i in range(3):
        log.append(True, 0, bytes([i]) * 16)
    _, events, lost = log.drain_from()
    assert lost and events == [] and log.seq == 3  # past the capacity nothing is kept: the consumer resyncs
    index = WorkerCacheIndex(CacheShape(16, (0,), (), 16))
    index.load_snapshot("e", 0, {})
    assert not index.apply(1, [(True, 0, b"x" * 16)])  # event 1 missed: a gap
    assert not index.synced
    index.load_snapshot("e", 3, {0: [b"y" * 16]})
    assert index.synced and index.apply(3, [(False, 0, b"y" * 16)]) and index.groups[0] == set()


def test_usable_hit_needs_a_checkpoint_in_every_recurrent_group() -> None:
    """Attention alone would rank worker a first (6 cached blocks vs 4); its state checkpoints end at block 3 in
    one recurrent group and block 2 in the other, so b (4 blocks, checkpoints at 4 in both groups) serves more."""
    shape = CacheShape(block_size=16, attention_groups=(0,), recurrent_groups=(1, 2), align=16)
    hashes = prompt_block_hashes(list(range(200)), 16)
    a, b = WorkerCacheIndex(shape), WorkerCacheIndex(shape)
    a.load_snapshot("e", 0, {0: hashes[:6], 1: [hashes[2]], 2: [hashes[1], hashes[2]]})
    b.load_snapshot("e", 0, {0: hashes[:4], 1: [hashes[3]], 2: [hashes[3]]})
    assert (a.transfer_hit(hashes, 199), b.transfer_hit(hashes, 199)) == (96, 64)
    assert (a.usable_hit(hashes, 200), b.usable_hit(hashes, 200)) == (48, 64)
    assert b.usable_hit(hashes, 64) == 0  # capped at N-1 = 63: b's only checkpoints are at 64
    assert a.usable_hit(hashes, 60) == 48
    b.expect({0: hashes[4:6], 1: [hashes[5]], 2: [hashes[5]]}, ttl_s=60)
    assert b.usable_hit(hashes, 200) == 96  # what the router just sent b counts until events arrive
    b.apply(0, [(False, 1, hashes[5])])  # a real event replaces the expectation
    assert b.usable_hit(hashes, 200) == 64


def test_every_group_of_a_kind_hears_the_same_events() -> None:
    """One block table for every attention group, one checkpoint for every recurrent group: each attention group gets
    the same stored / removed events (block hashes), each recurrent group the same (checkpoint hashes), in order."""
    from hybridpd.engine.cache.coordinator import PoolLayout
    from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec
    from hybridpd.engine.config import SchedulerConfig
    from hybridpd.engine.request import Request
    from hybridpd.engine.scheduler import Scheduler

    attn = FullAttentionSpec(block_size=4, num_kv_heads=1, head_dim=2, dtype="float32")
    mamba = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")
    groups = [CacheGroup(0, attn, (0,)), CacheGroup(1, mamba, (1,)), CacheGroup(2, attn, (2,)),
              CacheGroup(3, mamba, (3,))]
    cache = HybridCacheManager(groups, PoolLayout(14, 5, 0, 4, 2))  # 13 pages: little room, evictions
    sched = Scheduler(SchedulerConfig(2, 64), cache)
    index = WorkerCacheIndex(cache_shape(cache))
    index.load_snapshot("e", cache.events.seq, cache.cached_hashes())
    rng = random.Random(1)
    base = [rng.randrange(100) for _ in range(16)]
    per_group: dict[int, list[tuple[bool, bytes]]] = {0: [], 1: [], 2: [], 3: []}
    for i in range(10):
        sched.add_request(Request(f"r{i}", base[: rng.randrange(5, 17)] + [200 + i] * rng.randrange(0, 6),
                                  SamplingParams(max_tokens=3)))
        while sched.num_unfinished:
            out = sched.schedule()
            for r in sched.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample}):
                if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                    sched.finish(r, "length")
        _, events, lost = cache.events.drain_from()
        assert not lost
        for e in events:
            per_group[e.group].append((e.stored, e.block_hash))
        index.apply(index.seq, [(e.stored, e.group, e.block_hash) for e in events])
        assert index.groups == cache.cached_hashes()
        cache.check_integrity()
    assert per_group[0] == per_group[2] and per_group[1] == per_group[3]
    for kind in (0, 1):  # both kinds were stored and removed
        assert {stored for stored, _ in per_group[kind]} == {True, False}, kind
    snap = cache.cached_hashes()
    assert snap[0] == snap[2] == {h for h, n in cache.tree.nodes.items() if n.page}
    assert snap[1] == snap[3] == {h for h, n in cache.tree.nodes.items() if n.ckpt is not None}
