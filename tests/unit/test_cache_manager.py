"""HybridCacheManager with an attention group (block_size 4) and a Mamba-2 group (checkpoints every 8 tokens: the
vLLM-style `IntervalAdmission` of benchmarks/cache_policies.py), driven through the Scheduler with no model: exact hits,
pages, slots, checkpoints, saves, restores and counters on the page arena (engine/cache/arena.py).

    tokens  0..3 | 4..7 | 8..11 | 12..15 | 16..19      attention blocks (hashed when full): one page each
                        ^ ckpt 8        ^ ckpt 16       recurrent checkpoints (state after 8, 16 tokens): k = 3 pages

A hit is the largest checkpoint boundary <= min(attention hit, N - 1). Slots: null 0, running 1..max_num_seqs, then
STAGING_SLOTS staging slots; a checkpoint inside a chunk is written into a staging slot (while free slots exceed what
new requests may still need), one at a chunk's end is saved from the running slot. A fresh pool hands out pages
1, 2, 3, ... and the lowest free slot.
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
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.hashing import HASH_SEED, extra_keys
from hybridpd.engine.cache.specs import PAD_SLOT_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.cache.tree import STATE
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

from benchmarks.cache_policies import IntervalAdmission
from tests.support.pool_views import cached_blocks, checkpoint_pages, extend_block_hashes, free_pages, page_bytes

BS, INTERVAL = 4, 8
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")
K = -(-page_bytes([CacheGroup(1, MAMBA, (1, 2))]) // page_bytes([CacheGroup(0, ATTN, (0,))]))  # 160 B / 64 B -> 3
A = list(range(100, 120))  # a 20-token prompt


def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty


def make(
    kinds: str = "hybrid",
    num_pages: int = 32,
    interval: int = INTERVAL,
    budget: int = 64,
    max_num_seqs: int = 2,
) -> Scheduler:
    groups = {
        "hybrid": [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))],
        "attention": [CacheGroup(0, ATTN, (0, 1))],
        "recurrent": [CacheGroup(0, MAMBA, (0, 1))],
    }[kinds]
    slots = 0 if kinds == "attention" else 1 + max_num_seqs + STAGING_SLOTS
    k = K if kinds == "hybrid" else 1  # a model without attention: a page is one state
    cache = HybridCacheManager(groups, PoolLayout(num_pages, slots, interval, BS, k), admission_cls=IntervalAdmission)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), cache)


def add(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 1, salt: str | None = None) -> Request:
    req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), cache_salt=salt)
    s.add_request(req)
    return req


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, pretend it ran, sample token 7, finish at max_tokens."""
    out = s.schedule()
    drained(s)
    step_done(s, out)
    return out


def drained(s: Scheduler) -> None:
    """schedule() moved every fresh page, restore and save into its output."""
    assert not s.cache.take_fresh_blocks() and not s.cache.take_restores() and not s.cache.take_saves()


def step_done(s: Scheduler, out: SchedulerOutput) -> None:
    advanced = s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample})
    for req in advanced:
        if len(req.output_token_ids) >= req.sampling_params.max_tokens:
            s.finish(req, "length")
    s.cache.check_integrity()


def run(s: Scheduler) -> list[SchedulerOutput]:
    outs = []
    while s.num_unfinished:
        outs.append(step(s))
        assert len(outs) < 200
    return outs


def serve(s: Scheduler, rid: str, tokens: list[int], **kw: object) -> tuple[Request, list[SchedulerOutput]]:
    req = add(s, rid, tokens, **kw)  # type: ignore[arg-type]
    return req, run(s)


def block_page(s: Scheduler, h: bytes) -> int | None:
    """The page caching block `h` (None: not cached)."""
    node = s.cache.tree.nodes.get(h)
    return node.page or None if node is not None else None


def ckpt_pages(s: Scheduler, h: bytes) -> tuple[int, ...] | None:
    """The pages of the checkpoint cached at block `h` (None: none)."""
    node = s.cache.tree.nodes.get(h)
    return node.ckpt if node is not None else None


def counters(s: Scheduler) -> dict[str, tuple[int, int]]:
    return {k: (c.queries, c.hits) for k, c in s.cache.counters.items()}


# -- hits --------------------------------------------------------------------------------------------------------
def test_cold_request_gets_fresh_pages_slot_and_checkpoints() -> None:
    assert K == 3
    s = make()
    req, (out,) = serve(s, "a", A)
    assert req.num_cached_tokens == 0
    (seq,) = out.seqs
    assert lead(seq.group_block_ids) == (1, 2, 3, 4, 5)
    assert lead(out.group_fresh_blocks) == (1, 2, 3, 4, 5)
    assert lead(seq.group_state_slots, PAD_SLOT_ID) == 1
    assert lead(seq.group_checkpoints) == ((8, 2), (16, 3))  # both inside the chunk: staging slots 2, 3
    assert out.state_saves == ((2, (6, 7, 8)), (3, (9, 10, 11)))  # each copied to k fresh pages after the step
    assert out.state_restores == ()
    assert seq.sample and seq.num_computed_tokens == 0 and len(seq.token_ids) == 20
    # published: all 5 full attention blocks, both checkpoints; the staging slots are free again
    assert [block_page(s, h) for h in req.block_hashes] == [1, 2, 3, 4, 5]
    assert ckpt_pages(s, req.block_hashes[1]) == (6, 7, 8) and ckpt_pages(s, req.block_hashes[3]) == (9, 10, 11)
    assert cached_blocks(s.cache) == {1, 2, 3, 4, 5} and checkpoint_pages(s.cache) == set(range(6, 12))
    assert free_pages(s.cache) == set(range(12, 32))
    assert sorted(s.cache.slots.free) == [1, 2, 3, 4]
    assert counters(s) == {"attention": (20, 0), "mamba2": (20, 0)}


def test_repeated_prompt_hits_largest_checkpoint_and_restores_state() -> None:
    s = make()
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A)
    # attention could serve 16 (4 full blocks of N-1 = 19); checkpoint 16 exists -> hit 16
    assert req.num_cached_tokens == 16
    (seq,) = out.seqs
    assert seq.num_computed_tokens == 16 and seq.token_ids == (116, 117, 118, 119)
    assert lead(seq.group_block_ids) == (1, 2, 3, 4, 12)
    assert lead(out.group_fresh_blocks) == (12,)  # hits are not fresh
    assert lead(seq.group_state_slots, PAD_SLOT_ID) == 1
    assert out.state_restores == ((1, (9, 10, 11)),)  # checkpoint 16's pages -> running slot, before the step
    assert lead(seq.group_checkpoints) == () and out.state_saves == ()  # nothing new to checkpoint in (16, 20]
    assert seq.has_initial_state
    assert counters(s) == {"attention": (40, 16), "mamba2": (40, 16)}
    # page 12 recomputed tokens 16..19, which page 5 already names: the live copy takes the name (the chain stays
    # evictable) and page 5, free now, is the first page handed out (before any cached block is evicted)
    assert block_page(s, req.block_hashes[4]) == 12 and 5 not in cached_blocks(s.cache)
    assert s.cache.pages.free[-1] == 5
    assert s.cache.tree.num_evictions == [0, 0]


def test_shared_prefix_hits_the_common_checkpoint() -> None:
    s = make()
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A[:12] + [1, 2, 3, 4, 5, 6, 7, 8])
    # common prefix 12 tokens = 3 attention blocks; largest checkpoint <= 12 is 8 (pages 6, 7, 8)
    assert req.num_cached_tokens == 8
    assert lead(out.seqs[0].group_block_ids) == (1, 2, 12, 13, 14)
    assert lead(out.group_fresh_blocks) == (12, 13, 14)
    assert out.state_restores == ((1, (6, 7, 8)),)
    assert lead(out.seqs[0].group_checkpoints) == ((16, 2),)  # b's own boundary 16 differs from a's
    assert out.state_saves == ((2, (15, 16, 17)),)
    assert counters(s) == {"attention": (40, 12), "mamba2": (40, 8)}


def test_hit_is_capped_at_n_minus_one_and_a_chunk_end_checkpoint_is_saved_from_the_running_slot() -> None:
    s = make()
    prompt = A[:16]
    first, (out1,) = serve(s, "a", prompt)
    assert lead(out1.seqs[0].group_checkpoints) == ((8, 2),)  # 16 is the chunk's end: no staging slot
    assert out1.state_saves == ((2, (5, 6, 7)), (1, (8, 9, 10)))  # ... it is saved from the running slot 1
    assert block_page(s, first.block_hashes[3]) == 4  # all 16 tokens are cached ...
    again, (out2,) = serve(s, "b", prompt)
    assert again.num_cached_tokens == 8  # ... but the last token must be computed: 15 -> 12 -> checkpoint 8
    assert out2.seqs[0].token_ids == tuple(prompt[8:])
    assert out2.state_restores == ((1, (5, 6, 7)),)
    assert counters(s) == {"attention": (32, 12), "mamba2": (32, 8)}


def test_cache_salt_isolates() -> None:
    s = make(num_pages=64)  # room for every tenant's blocks and checkpoints
    serve(s, "a", A)
    salted, _ = serve(s, "b", A, salt="tenant-1")
    assert salted.num_cached_tokens == 0
    assert block_page(s, salted.block_hashes[0]) == 12  # its own page, under its own hash (a's block 0 is page 1)
    other, _ = serve(s, "c", A, salt="tenant-2")
    assert other.num_cached_tokens == 0
    same, _ = serve(s, "d", A, salt="tenant-1")
    assert same.num_cached_tokens == 16
    unsalted, _ = serve(s, "e", A)
    assert unsalted.num_cached_tokens == 16
    assert s.cache.tree.num_evictions == [0, 0]


def test_prefix_caching_off_never_hits_and_never_checkpoints() -> None:
    groups = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))]
    cache = HybridCacheManager(groups, PoolLayout(32, 1 + 2 + STAGING_SLOTS, INTERVAL, BS, K),
                               enable_prefix_caching=False, admission_cls=IntervalAdmission)
    s = Scheduler(SchedulerConfig(2, 64), cache)
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A)
    assert req.num_cached_tokens == 0 and lead(out.seqs[0].group_checkpoints) == ()
    assert out.state_restores == () and out.state_saves == ()
    assert cached_blocks(cache) == set() and checkpoint_pages(cache) == set() and not cache.tree.nodes
    assert free_pages(cache) == set(range(1, 32))


# -- checkpoints -------------------------------------------------------------------------------------------------
def test_checkpoints_planned_within_chunks_and_published_after_the_step() -> None:
    s = make(budget=6)  # chunks (0,6] (6,12] (12,18] (18,20]
    req = add(s, "a", A)
    out = s.schedule()
    assert lead(out.seqs[0].group_checkpoints) == () and out.state_saves == ()
    step_done(s, out)

    out = s.schedule()
    assert out.seqs[0].token_ids == tuple(A[6:12])
    assert lead(out.seqs[0].group_checkpoints) == ((8, 2),)
    assert out.state_saves == ((2, (4, 5, 6)),)  # the step's 3rd block took page 3
    h8 = req.block_hashes[1]
    assert ckpt_pages(s, h8) is None  # not written yet: not visible to hits
    assert s.cache.slots.held[2] and not {4, 5, 6} & free_pages(s.cache)  # reserved until the step ran
    assert s.cache.pages.ref[4] == 1 and s.cache.tree.ckpt_node.get(4) is None
    step_done(s, out)
    node = s.cache.tree.nodes[h8]
    assert node.ckpt == (4, 5, 6) and node.queued[STATE] and not node.ckpt_refs  # published, evictable
    assert not s.cache.slots.held[2]  # the staging slot is free again

    out = s.schedule()
    assert lead(out.seqs[0].group_checkpoints) == ((16, 2),)
    step_done(s, out)
    out = s.schedule()
    assert lead(out.seqs[0].group_checkpoints) == () and out.state_saves == () and out.seqs[0].sample
    step_done(s, out)
    assert req.is_finished
    assert ckpt_pages(s, req.block_hashes[3]) is not None


def test_checkpoints_during_decode_are_saved_from_the_running_slot() -> None:
    s = make()
    req, outs = serve(s, "a", A, max_tokens=6)  # 20 prompt + 5 computed outputs -> boundary 24 while decoding
    assert [lead(o.seqs[0].group_checkpoints) for o in outs] == [((8, 2), (16, 3)), (), (), (), (), ()]
    assert [len(o.state_saves) for o in outs] == [2, 0, 0, 0, 1, 0]
    (slot, pages), = outs[4].state_saves  # the chunk (23, 24] ends at 24: the running slot holds that state
    assert slot == 1 and len(pages) == K
    assert ckpt_pages(s, req.block_hashes[5]) == pages


def test_restored_checkpoint_protected_until_the_copy_ran() -> None:
    s = make()
    a, _ = serve(s, "a", A)
    n8, n16 = s.cache.tree.nodes[a.block_hashes[1]], s.cache.tree.nodes[a.block_hashes[3]]
    add(s, "b", A)
    out = s.schedule()
    assert out.state_restores == ((1, (9, 10, 11)),)
    assert n16.ckpt_refs == 1 and not n16.queued[STATE]  # not evictable until the copy ran
    assert n16.ckpt == (9, 10, 11) and s.cache.tree.ckpt_node.get(9) is n16  # still named
    step_done(s, out)
    # released after the step: queued again, after the checkpoint at 8 (re-queued last: ties go by release order)
    assert not n16.ckpt_refs and n16.queued[STATE] > n8.queued[STATE] > 0


def test_checkpoints_and_blocks_evict_each_other_in_one_page_pool() -> None:
    s = make(num_pages=1 + 16, max_num_seqs=1)  # a leaves 5 blocks + 2 checkpoints = 11 pages, 5 free
    a, _ = serve(s, "a", A)
    assert free_pages(s.cache) == set(range(12, 17))
    b, (out,) = serve(s, "b", list(range(200, 220)))
    # b's 5 blocks take the free pages; its checkpoints' 6 pages come from a's cache: first a's dead-end leaf block
    # (page 5: no checkpoint at it, worth 0), then a's checkpoints (pages 6..8, 9..11)
    assert lead(out.seqs[0].group_block_ids) == (12, 13, 14, 15, 16)
    assert lead(out.seqs[0].group_state_slots, PAD_SLOT_ID) == 1
    assert lead(out.seqs[0].group_checkpoints) == ((8, 2), (16, 3))
    assert out.state_saves == ((2, (8, 7, 6)), (3, (11, 10, 9)))
    assert s.cache.tree.num_evictions == [1, 2]
    assert [block_page(s, h) for h in a.block_hashes] == [1, 2, 3, 4, None]
    assert ckpt_pages(s, a.block_hashes[1]) is None and ckpt_pages(s, a.block_hashes[3]) is None
    again, _ = serve(s, "c", A)
    assert again.num_cached_tokens == 0  # attention still holds a's blocks but no checkpoint survived
    assert s.cache.counters["attention"].hits == 16 and s.cache.counters["mamba2"].hits == 0


def test_no_checkpoint_when_the_pages_are_full() -> None:
    s = make(num_pages=1 + 5, max_num_seqs=1)  # a's 5 blocks take every page: no room for a checkpoint
    _, (out,) = serve(s, "a", A)
    assert lead(out.seqs[0].group_checkpoints) == () and out.state_saves == ()
    assert checkpoint_pages(s.cache) == set() and not s.cache.slots.held[2]  # nothing reserved, no staging slot
    again, _ = serve(s, "b", A)
    assert again.num_cached_tokens == 0


def test_staging_slots_are_left_to_new_requests_that_need_a_running_slot() -> None:
    """A checkpoint inside a chunk takes a staging slot only while the free slots exceed what requests still to
    be admitted may need for running. Checkpoints are planned once every request of the step holds its blocks and
    running slot: a and b run in slots 1 and 2; a stages its checkpoints at 8 and 16 in slots 3 and 4; b finds no
    free slot, so its chunk ends at its first boundary (8), saved from its running slot, and resumes next step."""
    s = make(num_pages=64)
    add(s, "a", A)
    add(s, "b", list(range(200, 220)))
    out = s.schedule()
    drained(s)
    (sa, sb) = out.seqs
    assert (lead(sa.group_state_slots), lead(sa.group_checkpoints), len(sa.token_ids)) == (1, ((8, 3), (16, 4)), 20)
    assert (lead(sb.group_state_slots), lead(sb.group_checkpoints), len(sb.token_ids)) == (2, (), 8)
    assert sa.sample and not sb.sample  # b's chunk was cut: it samples once its prompt is done
    assert out.state_saves == ((3, (11, 12, 13)), (4, (14, 15, 16)), (2, (17, 18, 19)))
    step_done(s, out)
    assert not s.cache.slots.held[3] and not s.cache.slots.held[4]  # staging slots are free after the step
    assert s.requests["b"].num_computed_tokens == 8
    run(s)
    assert sorted(s.cache.slots.free) == [1, 2, 3, 4]


def test_a_checkpoint_without_room_does_not_cut_the_chunk() -> None:
    """As above, but the cap on cached checkpoints is taken by a's two: b's boundary finds no room, so it is
    skipped, and b's chunk runs whole (cut without a checkpoint, it would only have cost a step)."""
    s = make(num_pages=64)
    s.cache.tree.max_checkpoints = 2
    add(s, "a", A)
    add(s, "b", list(range(200, 220)))
    out = s.schedule()
    (sa, sb) = out.seqs
    assert lead(sa.group_checkpoints) == ((8, 3), (16, 4))
    assert (lead(sb.group_checkpoints), len(sb.token_ids), sb.sample) == ((), 20, True)
    assert [slot for slot, _ in out.state_saves] == [3, 4]  # a's only
    step_done(s, out)
    run(s)
    s.cache.check_integrity()


# -- fresh blocks ------------------------------------------------------------------------------------------------
def test_fresh_blocks_drained_every_step_and_exclude_hits() -> None:
    s = make(budget=6)
    a, _ = serve(s, "a", A)  # chunks of 6: blocks 1, 2 | 3, ckpt 8 -> 4..6 | 7, 8, ckpt 16 -> 9..11 | -
    assert [block_page(s, h) for h in a.block_hashes] == [1, 2, 3, 7, 8]
    add(s, "b", A, max_tokens=3)
    add(s, "c", A[:12] + [9] * 8)
    outs = run(s)
    fresh = [lead(o.group_fresh_blocks) for o in outs]
    # step 1: b (hit 16, pages 1, 2, 3, 7 reused) computes 16..19 -> 12; c (hit 8, pages 1, 2 reused) 8..9 -> 13
    # b's page 12 recomputed what a's page 8 names: 12 takes the name, 8 is free (and first handed out) again
    # step 2: b decodes token 20 -> 8; c computes 10..14 -> 14.   step 3: b token 21; c 15..19 -> 15
    assert fresh == [(12, 13), (8, 14), (15,)]
    assert [o.state_restores for o in outs[:1]] == [((1, (9, 10, 11)), (2, (4, 5, 6)))]
    seen: list[int] = []
    for f in fresh:
        assert not {1, 2, 3, 7} & set(f)  # hits are never fresh
        assert not set(seen) & set(f)  # each fresh page reported once (no page was freed and reallocated)
        seen.extend(f)
    assert not s.cache.take_fresh_blocks()


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
    monkeypatch.setattr(s.cache, "checkpoint_plan", lambda req, start, end: (s.cache._no_checkpoints, end))
    serve(s, "a", A)
    again, (out,) = serve(s, "b", A)
    assert again.num_cached_tokens == 0 and out.state_restores == ()
    assert counters(s) == {"attention": (40, 16), "mamba2": (40, 0)}


# -- single-kind models ----------------------------------------------------------------------------------------------
def test_attention_only_hits_full_blocks_capped_at_n_minus_one() -> None:
    s = make("attention")
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A)
    assert req.num_cached_tokens == 16
    assert out.seqs[0].group_state_slots == () and out.seqs[0].group_checkpoints == ()
    assert out.state_restores == () and out.state_saves == ()
    short, _ = serve(s, "c", A[:16])
    assert short.num_cached_tokens == 12  # no checkpoint alignment, only the N-1 cap
    odd, _ = serve(s, "d", A[:10])
    assert odd.num_cached_tokens == 8
    assert counters(s) == {"attention": (66, 36)}
    assert s.cache.attention_groups == [0] and s.cache.recurrent_groups == [] and s.cache.slots.num_slots == 0
    assert checkpoint_pages(s.cache) == set()


def test_recurrent_only_hits_checkpoints() -> None:
    """No attention: a page is one state (k = 1) and the pages hold checkpoints only."""
    s = make("recurrent")
    _, (out,) = serve(s, "a", A)
    assert lead(out.seqs[0].group_block_ids) == () and lead(out.group_fresh_blocks) == ()
    assert lead(out.seqs[0].group_state_slots) == 1
    assert lead(out.seqs[0].group_checkpoints) == ((8, 2), (16, 3))
    assert out.state_saves == ((2, (1,)), (3, (2,)))
    req, (out,) = serve(s, "b", A)
    assert req.num_cached_tokens == 16 and out.state_restores == ((1, (2,)),)
    short, _ = serve(s, "c", A[:16])
    assert short.num_cached_tokens == 8
    assert counters(s) == {"mamba2": (56, 24)}
    assert cached_blocks(s.cache) == set() and checkpoint_pages(s.cache) == {1, 2}


def test_several_groups_of_one_kind_share_one_block_table_and_one_slot() -> None:
    """Several groups of one kind: every attention group gets the same block table (block j of every attention
    group is page j), every recurrent group the same slot and the same checkpoints, and each group reports the
    same events; counters are labelled per group."""
    groups = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, FullAttentionSpec(4, 2, 2, "float32"), (1,)),
              CacheGroup(2, MAMBA, (2,)), CacheGroup(3, RecurrentStateSpec("gated_deltanet", (6, 3), "float32",
                                                                           (2, 4, 4), "float32"), (3,))]
    k = -(-page_bytes(groups[2:]) // page_bytes(groups[:2]))
    cache = HybridCacheManager(groups, PoolLayout(64, 1 + 2 + STAGING_SLOTS, INTERVAL, BS, k),
                               admission_cls=IntervalAdmission)
    assert set(cache.counters) == {"attention:0", "attention:1", "mamba2", "gated_deltanet"}
    s = Scheduler(SchedulerConfig(2, 64), cache)
    serve(s, "a", A)
    req, (out,) = serve(s, "b", A)
    (seq,) = out.seqs
    assert [g for g, _ in seq.group_block_ids] == [0, 1] and [g for g, _ in seq.group_state_slots] == [2, 3]
    assert len({ids for _, ids in seq.group_block_ids}) == 1 and len({sl for _, sl in seq.group_state_slots}) == 1
    assert [g for g, _ in out.group_fresh_blocks] == [0, 1] and len({f for _, f in out.group_fresh_blocks}) == 1
    assert req.num_cached_tokens == 16 and out.state_restores == ((1, ckpt_pages(s, req.block_hashes[3])),)
    assert len(out.state_restores[0][1]) == k
    assert {label: c.hits for label, c in cache.counters.items()} == dict.fromkeys(cache.counters, 16)
    _, events, _ = cache.events.drain_from()
    by_group = {g: [(e.stored, e.block_hash) for e in events if e.group == g] for g in range(4)}
    assert by_group[0] == by_group[1] and by_group[2] == by_group[3] and by_group[0] and by_group[2]
    snapshot = cache.cached_hashes()
    assert snapshot[0] == snapshot[1] and snapshot[2] == snapshot[3]
    cache.check_integrity()


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
