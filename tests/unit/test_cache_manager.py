"""HybridCacheManager with an attention group (block_size 4) and a Mamba-2 group (checkpoints every 8 tokens: the
vLLM-style `IntervalAdmission` of benchmarks/cache_policies.py), driven through the Scheduler with no model: exact hits,
block ids, slots, checkpoints, copies and counters.

    tokens  0..3 | 4..7 | 8..11 | 12..15 | 16..19      attention blocks (hashed when full)
                        ^ ckpt 8        ^ ckpt 16       recurrent checkpoints (state after 8, 16 tokens)

A hit is the largest checkpoint boundary <= min(attention hit, N - 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.hashing import HASH_SEED, extra_keys
from hybridpd.engine.cache.specs import PAD_SLOT_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

from benchmarks.cache_policies import IntervalAdmission
from tests.support.pool_views import extend_block_hashes, free_order

BS, INTERVAL = 4, 8
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")
A = list(range(100, 120))  # a 20-token prompt

def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty



def make(
    kinds: str = "hybrid",
    attention_blocks: int = 32,
    state_slots: int = 7,
    interval: int = INTERVAL,
    budget: int = 64,
    max_num_seqs: int = 2,
) -> Scheduler:
    groups = {
        "hybrid": [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))],
        "attention": [CacheGroup(0, ATTN, (0, 1))],
        "recurrent": [CacheGroup(0, MAMBA, (0, 1))],
    }[kinds]
    cache = HybridCacheManager(groups, PoolLayout(attention_blocks, state_slots, interval, BS),
                               admission_cls=IntervalAdmission)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), cache)


def add(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 1, salt: str | None = None) -> Request:
    req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), cache_salt=salt)
    s.add_request(req)
    return req


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, pretend it ran, sample token 7, finish at max_tokens."""
    out = s.schedule()
    assert all(not v for v in s.cache.take_group_fresh_blocks().values())  # drained into the output every step
    assert all(not v for v in s.cache.take_group_state_copies().values())
    advanced = s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample})
    for req in advanced:
        if len(req.output_token_ids) >= req.sampling_params.max_tokens:
            s.finish(req, "length")
    s.cache.check_integrity()
    return out


def run(s: Scheduler) -> list[SchedulerOutput]:
    outs = []
    while s.num_unfinished:
        outs.append(step(s))
        assert len(outs) < 200
    return outs


def serve(s: Scheduler, rid: str, tokens: list[int], **kw: object) -> tuple[Request, list[SchedulerOutput]]:
    req = add(s, rid, tokens, **kw)  # type: ignore[arg-type]
    return req, run(s)


def attn_pool(s: Scheduler):  # type: ignore[no-untyped-def]
    assert s.cache.attention is not None
    return s.cache.attention.pool


def state_pool(s: Scheduler):  # type: ignore[no-untyped-def]
    assert s.cache.recurrent is not None
    return s.cache.recurrent.pool


def counters(s: Scheduler) -> dict[str, tuple[int, int]]:
    return {k: (c.queries, c.hits) for k, c in s.cache.counters.items()}


# -- hits --------------------------------------------------------------------------------------------------------
def test_cold_request_gets_fresh_blocks_slot_and_checkpoints() -> None:
    s = make()
    req, (out,) = serve(s, "a", A)
    assert req.num_cached_tokens == 0
    (seq,) = out.seqs
    assert lead(seq.group_block_ids) == (1, 2, 3, 4, 5)
    assert lead(out.group_fresh_blocks) == (1, 2, 3, 4, 5)
    assert lead(seq.group_state_slots, PAD_SLOT_ID) == 1
    assert lead(seq.group_checkpoints) == ((8, 2), (16, 3))
    assert lead(out.group_state_copies) == ()
    assert seq.sample and seq.num_computed_tokens == 0 and len(seq.token_ids) == 20
    # published: all 5 full attention blocks, both checkpoints; freed tail first
    assert [attn_pool(s).lookup(h) for h in req.block_hashes] == [1, 2, 3, 4, 5]
    assert state_pool(s).lookup(req.block_hashes[1]) == 2 and state_pool(s).lookup(req.block_hashes[3]) == 3
    assert free_order(attn_pool(s))[-5:] == [5, 4, 3, 2, 1]
    # checkpoints 2, 3 are cached (back of the queue); the running slot holds nothing reusable: front
    assert free_order(state_pool(s)) == [1, 4, 5, 6, 2, 3]
    assert counters(s) == {"attention": (20, 0), "mamba2": (20, 0)}


def test_repeated_prompt_hits_largest_checkpoint_and_copies_state() -> None:
    s = make()
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A)
    # attention could serve 16 (4 full blocks of N-1 = 19); checkpoint 16 exists -> hit 16
    assert req.num_cached_tokens == 16
    (seq,) = out.seqs
    assert seq.num_computed_tokens == 16 and seq.token_ids == (116, 117, 118, 119)
    assert lead(seq.group_block_ids) == (1, 2, 3, 4, 6)
    assert lead(out.group_fresh_blocks) == (6,)  # hits are not fresh
    assert lead(seq.group_state_slots, PAD_SLOT_ID) == 1
    assert lead(out.group_state_copies) == ((3, 1),)  # checkpoint 16 -> running slot
    assert lead(seq.group_checkpoints) == ()  # nothing new to checkpoint in (16, 20]
    assert seq.has_initial_state
    assert counters(s) == {"attention": (40, 16), "mamba2": (40, 16)}
    # block 6 recomputed tokens 16..19, which block 5 already names: the live copy takes the name (the chain stays
    # evictable) and block 5, free now, is the first block handed out (before any cached block is evicted)
    assert attn_pool(s).block_hash[5] is None and free_order(attn_pool(s))[0] == 5
    assert attn_pool(s).block_hash[6] is not None
    assert attn_pool(s).num_evictions == 0


def test_shared_prefix_hits_the_common_checkpoint() -> None:
    s = make()
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A[:12] + [1, 2, 3, 4, 5, 6, 7, 8])
    # common prefix 12 tokens = 3 attention blocks; largest checkpoint <= 12 is 8 (slot 2)
    assert req.num_cached_tokens == 8
    assert lead(out.seqs[0].group_block_ids) == (1, 2, 6, 7, 8)
    assert lead(out.group_fresh_blocks) == (6, 7, 8)
    assert lead(out.group_state_copies) == ((2, 1),)
    assert lead(out.seqs[0].group_checkpoints) == ((16, 4),)  # b's own boundary 16 differs from a's
    assert counters(s) == {"attention": (40, 12), "mamba2": (40, 8)}


def test_hit_is_capped_at_n_minus_one() -> None:
    s = make()
    prompt = A[:16]
    first, (out1,) = serve(s, "a", prompt)
    assert lead(out1.seqs[0].group_checkpoints) == ((8, 2), (16, 3))
    assert attn_pool(s).lookup(first.block_hashes[3]) == 4  # all 16 tokens are cached ...
    again, (out2,) = serve(s, "b", prompt)
    assert again.num_cached_tokens == 8  # ... but the last token must be computed: 15 -> 12 -> checkpoint 8
    assert out2.seqs[0].token_ids == tuple(prompt[8:])
    assert lead(out2.group_state_copies) == ((2, 1),)
    assert counters(s) == {"attention": (32, 12), "mamba2": (32, 8)}


def test_cache_salt_isolates() -> None:
    s = make(state_slots=16)  # room for every tenant's checkpoints
    serve(s, "a", A)
    salted, _ = serve(s, "b", A, salt="tenant-1")
    assert salted.num_cached_tokens == 0
    assert salted.block_hashes[0] != s.cache.attention.pool.block_hash[1]  # type: ignore[union-attr]
    other, _ = serve(s, "c", A, salt="tenant-2")
    assert other.num_cached_tokens == 0
    same, _ = serve(s, "d", A, salt="tenant-1")
    assert same.num_cached_tokens == 16
    unsalted, _ = serve(s, "e", A)
    assert unsalted.num_cached_tokens == 16


def test_prefix_caching_off_never_hits_and_never_checkpoints() -> None:
    groups = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))]
    cache = HybridCacheManager(groups, PoolLayout(32, 7, INTERVAL, BS), enable_prefix_caching=False,
                               admission_cls=IntervalAdmission)
    s = Scheduler(SchedulerConfig(2, 64), cache)
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A)
    assert req.num_cached_tokens == 0 and lead(out.seqs[0].group_checkpoints) == ()
    assert lead(out.group_state_copies) == ()
    assert attn_pool(s).cached == {} and state_pool(s).cached == {}


# -- checkpoints -------------------------------------------------------------------------------------------------
def test_checkpoints_planned_within_chunks_and_published_after_the_step() -> None:
    s = make(budget=6)  # chunks (0,6] (6,12] (12,18] (18,20]
    req = add(s, "a", A)
    sp = state_pool(s)
    out = s.schedule()
    assert lead(out.seqs[0].group_checkpoints) == ()
    step_done(s, out)

    out = s.schedule()
    assert out.seqs[0].token_ids == tuple(A[6:12])
    assert lead(out.seqs[0].group_checkpoints) == ((8, 2),)
    h8 = req.block_hashes[1]
    assert sp.lookup(h8) is None  # not written yet: not visible to hits
    assert sp.ref_cnt[2] == 1 and 2 not in free_order(sp)  # protected until the step ran
    step_done(s, out)
    assert sp.lookup(h8) == 2 and sp.ref_cnt[2] == 0 and free_order(sp)[-1] == 2  # published, evictable

    out = s.schedule()
    assert lead(out.seqs[0].group_checkpoints) == ((16, 3),)
    step_done(s, out)
    out = s.schedule()
    assert lead(out.seqs[0].group_checkpoints) == () and out.seqs[0].sample
    step_done(s, out)
    assert req.is_finished
    assert sp.lookup(req.block_hashes[3]) == 3


def step_done(s: Scheduler, out: SchedulerOutput) -> None:
    advanced = s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample})
    for req in advanced:
        if len(req.output_token_ids) >= req.sampling_params.max_tokens:
            s.finish(req, "length")
    s.cache.check_integrity()


def test_checkpoints_during_decode() -> None:
    s = make()
    req, outs = serve(s, "a", A, max_tokens=6)  # 20 prompt + 5 computed outputs -> boundary 24 while decoding
    assert [lead(o.seqs[0].group_checkpoints) for o in outs] == [((8, 2), (16, 3)), (), (), (), ((24, 4),), ()]
    assert state_pool(s).lookup(req.block_hashes[5]) == 4


def test_restored_checkpoint_protected_until_the_copy_ran() -> None:
    s = make()
    serve(s, "a", A)
    sp = state_pool(s)
    add(s, "b", A)
    out = s.schedule()
    assert lead(out.group_state_copies) == ((3, 1),)
    assert sp.ref_cnt[3] == 1 and 3 not in free_order(sp)
    assert sp.lookup(s.requests["b"].block_hashes[3]) == 3  # still named
    step_done(s, out)
    # released after the step: the restored checkpoint is now the most recently used cached slot
    assert sp.ref_cnt[3] == 0 and free_order(sp) == [1, 4, 5, 6, 2, 3]


def test_checkpoints_are_evictable_lru() -> None:
    s = make(state_slots=4, max_num_seqs=1)  # null + 3 slots: running + 2 checkpoints
    a, _ = serve(s, "a", A)
    sp = state_pool(s)
    assert free_order(sp) == [1, 2, 3]  # running slot 1 (free) first, then ckpt 8 -> 2, ckpt 16 -> 3
    b, (out,) = serve(s, "b", list(range(200, 220)))
    # b's running slot takes the free slot 1; its checkpoints evict a's, oldest first
    assert lead(out.seqs[0].group_state_slots, PAD_SLOT_ID) == 1
    assert lead(out.seqs[0].group_checkpoints) == ((8, 2), (16, 3))
    assert sp.lookup(a.block_hashes[1]) is None and sp.lookup(a.block_hashes[3]) is None
    assert sp.num_evictions == 2
    again, _ = serve(s, "c", A)
    assert again.num_cached_tokens == 0  # attention still holds a's blocks but no checkpoint survived
    assert s.cache.counters["attention"].hits == 16 and s.cache.counters["mamba2"].hits == 0


def test_no_checkpoint_when_pool_is_full() -> None:
    s = make(state_slots=2, max_num_seqs=1)  # null + 1 running slot, no checkpoint room
    _, (out,) = serve(s, "a", A)
    assert lead(out.seqs[0].group_checkpoints) == ()
    again, _ = serve(s, "b", A)
    assert again.num_cached_tokens == 0


# -- fresh blocks ------------------------------------------------------------------------------------------------
def test_fresh_blocks_drained_every_step_and_exclude_hits() -> None:
    s = make(budget=6)
    serve(s, "a", A)
    add(s, "b", A, max_tokens=3)
    add(s, "c", A[:12] + [9] * 8)
    outs = run(s)
    fresh = [lead(o.group_fresh_blocks) for o in outs]
    # step 1: b (hit 16, blocks 1..4 reused) computes 16..19 -> 6; c (hit 8, blocks 1, 2 reused) 8..9 -> 7
    # b's block 6 recomputed what a's block 5 names: 6 takes the name, 5 is free (and first handed out) again
    # step 2: b decodes token 20 -> 5; c computes 10..14 -> 8.   step 3: b token 21; c 15..19 -> 9
    assert fresh == [(6, 7), (5, 8), (9,)]
    hits = {1, 2, 3, 4}
    seen: list[int] = []
    for f in fresh:
        assert not hits & set(f)
        assert not set(seen) & set(f)  # each fresh block reported once (no block was freed and reallocated)
        seen.extend(f)
    assert all(not v for v in s.cache.take_group_fresh_blocks().values())


# -- counters: per-group shape -----------------------------------------------------------------------------------------
def test_recurrent_hits_zero_when_checkpoints_are_never_written() -> None:
    """A model whose runner never writes checkpoints (here: interval longer than any prompt) must not report the
    attention hit as the prefix-cache hit: attention hits > 0, recurrent hits 0, overall hit 0."""
    s = make(interval=32)
    serve(s, "a", A)
    again, _ = serve(s, "b", A)
    assert again.num_cached_tokens == 0
    assert counters(s) == {"attention": (40, 16), "mamba2": (40, 0)}


def test_recurrent_hits_zero_when_runner_drops_checkpoint_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    s = make()
    monkeypatch.setattr(s.cache, "checkpoint_plan", lambda req, start, end: ())
    serve(s, "a", A)
    again, (out,) = serve(s, "b", A)
    assert again.num_cached_tokens == 0 and lead(out.group_state_copies) == ()
    assert counters(s) == {"attention": (40, 16), "mamba2": (40, 0)}


# -- single-kind models ----------------------------------------------------------------------------------------------
def test_attention_only_hits_full_blocks_capped_at_n_minus_one() -> None:
    s = make("attention")
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A)
    assert req.num_cached_tokens == 16
    assert out.seqs[0].group_state_slots == () and out.seqs[0].group_checkpoints == ()
    assert out.group_state_copies == ()
    short, _ = serve(s, "c", A[:16])
    assert short.num_cached_tokens == 12  # no checkpoint alignment, only the N-1 cap
    odd, _ = serve(s, "d", A[:10])
    assert odd.num_cached_tokens == 8
    assert counters(s) == {"attention": (66, 36)}
    assert s.cache.pools.keys() == {0}


def test_recurrent_only_hits_checkpoints() -> None:
    s = make("recurrent")
    _, (out,) = serve(s, "a", A)
    assert lead(out.seqs[0].group_block_ids) == () and lead(out.group_fresh_blocks) == ()
    assert lead(out.seqs[0].group_state_slots) == 1
    assert lead(out.seqs[0].group_checkpoints) == ((8, 2), (16, 3))
    req, (out,) = serve(s, "b", A)
    assert req.num_cached_tokens == 16 and lead(out.group_state_copies) == ((3, 1),)
    short, _ = serve(s, "c", A[:16])
    assert short.num_cached_tokens == 8
    assert counters(s) == {"mamba2": (56, 24)}


def test_several_groups_per_kind_get_a_pool_each() -> None:
    """Was refused (one group per kind); now each group has its own pool and labelled counters
    (several groups per kind are exercised in test_cache_groups.py)."""
    groups = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, FullAttentionSpec(4, 2, 2, "float32"), (1,))]
    cache = HybridCacheManager(groups, PoolLayout(8, 4, INTERVAL, BS), admission_cls=IntervalAdmission)
    assert sorted(cache.pools) == [0, 1] and cache.pools[0] is not cache.pools[1]
    assert set(cache.counters) == {"attention:0", "attention:1"}


def test_interval_must_be_a_multiple_of_block_size() -> None:
    with pytest.raises(ValueError, match="checkpoint_interval 6 is not a multiple of block_size 4"):
        make(interval=6)


# -- hashing ---------------------------------------------------------------------------------------------------------
KNOWN = ["5863175025fa14c79c4824133f8a5808", "c6cbd38e36fcba5ce096031f75cd1fca"]
KNOWN_SALTED = ["10a0377a259fd9b617692e53fc7beca0", "7d2d1ab45062feb47cd5563f771a55a1"]


def test_block_hashes_are_fixed_values() -> None:
    """Producer and consumer compute equal hashes for equal prefixes: pinned, so any format change is deliberate."""
    h: list[bytes] = []
    extend_block_hashes(h, list(range(35)), 16)  # 3 tokens past the last full block are not hashed
    assert [x.hex() for x in h] == KNOWN
    salted: list[bytes] = []
    extend_block_hashes(salted, list(range(32)), 16, extra_keys("tenant"))
    assert [x.hex() for x in salted] == KNOWN_SALTED
    assert extra_keys(None) == extra_keys("") == b""


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """The definition in hashing.py's docstring, one block at a time (the reference for the batched hashing)."""
    h = hashlib.sha256(parent if parent is not None else hashlib.sha256(HASH_SEED).digest()[:16])
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00salt\x00" + extra)
    return h.digest()[:16]


def test_batched_hashing_equals_the_per_block_chain_and_incremental_growth() -> None:
    tokens = [(i * 7919) % 151_000 for i in range(1000)]
    for extra in (b"", b"salt"):
        one_shot: list[bytes] = []
        extend_block_hashes(one_shot, tokens, 16, extra)
        chain, parent = [], None
        for i in range(len(tokens) // 16):
            parent = hash_block(parent, tokens[i * 16 : (i + 1) * 16], extra)
            chain.append(parent)
        assert one_shot == chain and len(chain) == 62
        grown: list[bytes] = []
        for n in range(0, len(tokens) + 1, 37):  # decode-style growth, odd steps
            extend_block_hashes(grown, tokens[:n], 16, extra)
        extend_block_hashes(grown, tokens, 16, extra)
        assert grown == chain


def test_block_hashes_equal_across_processes() -> None:
    code = (
        "from engine.cache.hashing import append_block_hashes as a; h = []; a(h, list(range(32)), 16); "
        "print(','.join(x.hex() for x in h))"
    )
    repo = Path(__file__).resolve().parents[2]
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().split(",") == KNOWN


def test_token_slice_spans_prompt_and_outputs() -> None:
    req = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=9))
    req.output_token_ids.extend([5, 6, 7])
    for start in range(8):
        for end in range(start, 9):
            assert req.token_slice(start, end) == req.all_token_ids[start:end], (start, end)


def test_scheduled_seq_fields_in_the_order_the_scheduler_passes_them() -> None:
    """Scheduler._schedule_seq builds ScheduledSeq positionally (keywords cost 2.5x per request per step)."""
    assert [f.name for f in dataclasses.fields(ScheduledSeq)] == [
        "request_id", "num_computed_tokens", "token_ids", "sample",
        "group_block_ids", "group_state_slots", "group_checkpoints", "prompt_scores"]
    s = make()
    _, (out,) = serve(s, "a", A)
    seq = out.seqs[0]
    assert seq.request_id == "a" and seq.num_computed_tokens == 0 and seq.token_ids == tuple(A) and seq.sample
