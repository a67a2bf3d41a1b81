"""Property tests: random traces through Scheduler + HybridCacheManager with no model, on arenas small enough that
preemption, eviction and chunking happen all the time.

A shadow model stands in for the device: it records what each page (an attention block, or one k-th of a
checkpoint) and each state slot holds, as (cache_salt, token prefix), when a step writes it (restores before the
forward, the forward, saves after it), and checks every read against what the request needs. So a hit on a wrong,
evicted or overwritten block, a checkpoint restored from pages a block has overwritten since (blocks and
checkpoints share one page pool), a checkpoint restored into the wrong slot, or a shared block being written,
fails here even when ref counts look fine.

Each trace runs one cache policy on the page arena (engine/cache/arena.py): the vLLM-style baseline
(fixed-interval checkpoints, LRU eviction: benchmarks/cache_policies.py), or reuse admission (branch points, prompt
ends, rolling request ends) with value or LRU eviction, or the interval fallback with value eviction; some with a cap
on cached checkpoints. Pages are few enough that blocks and checkpoints evict each other.

After every step: check_integrity(); ref count == holders for every page, slots held == running + staging; pages
held by two requests are cached prefix blocks; running slots unique and never 0; mid-chunk checkpoints in staging
slots nobody runs on, chunk-end ones saved from the running slot; fresh pages, restores and saves drained by
schedule(). At the end: no leak (nothing in use, free + cached == capacity, every slot free).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.hashing import extra_keys
from hybridpd.engine.cache.specs import NULL_BLOCK_ID, PAD_SLOT_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.cache.tree import CacheTree
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerOutput
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.cache_policies import IntervalAdmission, LruTree
from tests.support.pool_views import cached_blocks, checkpoint_pages, extend_block_hashes, free_pages, page_bytes

BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
GDN = RecurrentStateSpec("gated_deltanet", (6, 3), "bfloat16", (2, 4, 4), "float32")
PREFIXES = [list(range(1000, 1024)), list(range(2000, 2013)), [5] * 20]  # shared prefixes (one repetitive)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty


@dataclass(frozen=True)
class ReqSpec:
    prefix: int  # index into PREFIXES, or -1
    prefix_len: int
    suffix: tuple[int, ...]
    max_tokens: int
    salt: str | None
    arrival: int
    abort_at: int | None
    prefill_only: bool
    lease_steps: int

    def prompt(self) -> list[int]:
        head = PREFIXES[self.prefix][: self.prefix_len] if self.prefix >= 0 else []
        return head + list(self.suffix) or [3]

    def compute_target(self) -> int | None:
        """Prefill-only requests compute N-1 tokens (a 1-token prompt cannot be prefill-only)."""
        n = len(self.prompt())
        return n - 1 if self.prefill_only and n > 1 else None

    def max_blocks(self) -> int:
        """Blocks the request holds at its peak: every request must fit alone (the engine guarantees it by
        max_model_len <= token_capacity), or preemption by recompute cannot make progress."""
        target = self.compute_target()
        return cdiv(target if target is not None else len(self.prompt()) + self.max_tokens - 1, BS)


@dataclass(frozen=True)
class Trace:
    kinds: str
    interval: int
    max_num_seqs: int
    budget: int
    checkpoint_slots: int
    """Pages beyond the largest request's blocks, in checkpoints' worth (k pages each)."""
    spare_blocks: int
    caching: bool
    reqs: tuple[ReqSpec, ...]
    policy: str = "legacy"
    """legacy (interval admission + LRU: the vLLM-style baseline) | reuse-value | reuse-lru | interval-value"""
    spare_bytes: int = 0
    """More pages: this many bytes' worth."""
    max_checkpoints: int | None = None
    """A cap on cached checkpoints (PoolLayout.max_checkpoints)."""

    def cache_policy(self) -> CachePolicy:
        return CachePolicy(self.interval if self.policy in ("legacy", "interval-value") else 0)

    @property
    def tree_cls(self) -> type[CacheTree]:
        """The eviction order: the engine's, or the LRU baseline (benchmarks/cache_policies.py)."""
        return LruTree if self.policy in ("legacy", "reuse-lru") else CacheTree

    @property
    def admission_cls(self) -> type[Admission]:
        """Where checkpoints go: the engine's admission, or every `interval` tokens (the vLLM-style baseline)."""
        return IntervalAdmission if self.policy in ("legacy", "interval-value") else Admission


req_specs = st.builds(
    ReqSpec,
    prefix=st.sampled_from([0, 0, 0, 1, 2, -1]),
    prefix_len=st.sampled_from([8, 16, 16, 24]) | st.integers(0, 24),
    suffix=st.lists(st.integers(0, 9), max_size=10).map(tuple),
    max_tokens=st.integers(1, 9),
    salt=st.sampled_from([None, None, "t1"]),
    arrival=st.integers(0, 8),
    abort_at=st.one_of(st.none(), st.none(), st.integers(0, 30)),
    prefill_only=st.sampled_from([False, False, False, True]),
    lease_steps=st.integers(0, 3),
)

traces = st.builds(
    Trace,
    kinds=st.sampled_from(["hybrid", "hybrid", "attention", "recurrent"]),
    interval=st.sampled_from([4, 8, 12]),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 24),
    checkpoint_slots=st.integers(0, 4),
    spare_blocks=st.integers(0, 3) | st.integers(0, 12),
    caching=st.sampled_from([True, True, True, False]),
    reqs=st.lists(req_specs, min_size=2, max_size=12).map(tuple),
    policy=st.sampled_from(["legacy", "reuse-value", "reuse-value", "reuse-lru", "interval-value"]),
    spare_bytes=st.integers(0, 2000) | st.integers(0, 200),
    max_checkpoints=st.none() | st.integers(0, 3),
)


def next_token(req: Request) -> int:
    """Deterministic in position (like greedy decoding): equal prefixes continue equally."""
    return (req.num_tokens * 7) % 11


class Shadow:
    """What the device would hold: page -> ("kv", salt, prefix) for an attention block or ("state", salt, prefix,
    i) for piece i of a checkpoint; state slot -> (salt, prefix)."""

    def __init__(self) -> None:
        self.page: dict[int, tuple[object, ...]] = {}
        self.state: dict[int, tuple[str | None, tuple[int, ...]]] = {}


class Harness:
    def __init__(self, trace: Trace) -> None:
        self.t = trace
        groups = {
            "hybrid": [CacheGroup(0, ATTN, (0, 3)), CacheGroup(1, GDN, (1, 2, 4))],
            "attention": [CacheGroup(0, ATTN, (0, 1))],
            "recurrent": [CacheGroup(0, GDN, (0, 1))],
        }[trace.kinds]
        attn = [g for g in groups if g.is_attention]
        rec = [g for g in groups if not g.is_attention]
        page = page_bytes(attn) if attn else page_bytes(rec)
        self.k = cdiv(page_bytes(rec), page) if rec else 0
        need = max(r.max_blocks() for r in trace.reqs) if attn else 0
        num_pages = 1 + need + trace.spare_blocks + trace.checkpoint_slots * max(self.k, 1) + trace.spare_bytes // page
        layout = PoolLayout(
            num_pages=max(2, num_pages),
            num_slots=1 + trace.max_num_seqs + STAGING_SLOTS,
            checkpoint_interval=trace.interval,
            block_size=BS,
            pages_per_state=max(self.k, 1),
            policy=trace.cache_policy(),
            max_checkpoints=trace.max_checkpoints,
        )
        self.cache = HybridCacheManager(groups, layout, enable_prefix_caching=trace.caching, tree_cls=trace.tree_cls,
                                        admission_cls=trace.admission_cls)
        self.sched = Scheduler(SchedulerConfig(trace.max_num_seqs, trace.budget), self.cache)
        self.shadow = Shadow()
        self.leased: dict[str, tuple[Request, int]] = {}  # finished prefill-only requests holding caches
        self.reqs: dict[str, Request] = {}
        self.step_no = 0
        self.num_saves = self.num_restores = 0

    # -- driving -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        pending = sorted(enumerate(self.t.reqs), key=lambda kv: kv[1].arrival)
        while pending or self.sched.num_unfinished or self.leased:
            while pending and pending[0][1].arrival <= self.step_no:
                i, spec = pending.pop(0)
                prompt = spec.prompt()
                req = Request(
                    f"r{i}", prompt, SamplingParams(max_tokens=spec.max_tokens), arrival_index=i, cache_salt=spec.salt,
                    compute_target=spec.compute_target(),
                )
                self.reqs[req.request_id] = req
                self.sched.add_request(req)
            for rid, spec in ((f"r{i}", s) for i, s in enumerate(self.t.reqs)):
                if spec.abort_at == self.step_no and rid in self.sched.requests:
                    self.sched.abort(rid)
            for rid, (req, until) in list(self.leased.items()):
                if until <= self.step_no:
                    self.sched.release(req)
                    del self.leased[rid]
            self.cache.check_integrity()
            self.check_holders()
            self.one_step()
            self.step_no += 1
            assert self.step_no < 600, "no progress"
        self.check_no_leak()

    def one_step(self) -> None:
        waiting = {r.request_id for r in self.sched.waiting}
        out = self.sched.schedule()
        cache = self.cache
        assert not cache.take_fresh_blocks() and not cache.take_restores() and not cache.take_saves()  # drained
        self.check_schedule(out, waiting)
        self.simulate(out)
        sampled = {
            s.request_id: (next_token(self.sched.requests[s.request_id]), 0.0) for s in out.seqs if s.sample
        }
        advanced = self.sched.update_from_output(out, sampled)
        self.check_published(out)
        for req in advanced:
            spec = self.t.reqs[req.arrival_index]
            if req.compute_target is not None and req.num_computed_tokens >= req.compute_target:
                self.sched.finish(req, "prefilled", free_caches=False)
                self.leased[req.request_id] = (req, self.step_no + spec.lease_steps)
            elif len(req.output_token_ids) >= req.sampling_params.max_tokens:
                self.sched.finish(req, "length")
        cache.check_integrity()
        self.check_holders()
        self.check_hashes(advanced)

    # -- checks ----------------------------------------------------------------------------------------------------
    def check_schedule(self, out: SchedulerOutput, waiting: set[str]) -> None:
        cache, tree = self.cache, self.cache.tree
        ref = cache.pages.ref
        assert sum(s.num_new_tokens for s in out.seqs) <= self.t.budget
        assert len(self.sched.running) <= self.t.max_num_seqs
        ids = [s.request_id for s in out.seqs]
        assert len(ids) == len(set(ids))
        fresh = set(lead(out.group_fresh_blocks))
        assert len(fresh) == len(lead(out.group_fresh_blocks))
        for b in fresh:
            assert b != NULL_BLOCK_ID and ref[b] == 1 and tree.page_node[b] is None and b not in checkpoint_pages(cache)
        restores = dict(out.state_restores)
        assert len(restores) == len(out.state_restores)
        running = {cache.running_slot[r.request_id] for r in self.sched.running} if cache.has_states else set()
        staged: list[int] = []
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            assert 0 < s.num_new_tokens and end <= req.target_tokens
            assert s.token_ids == tuple(req.all_token_ids[start:end])
            if s.request_id in waiting:
                self.check_hit(req, start, fresh, restores)
            else:
                assert lead(s.group_state_slots, PAD_SLOT_ID) not in restores
            if cache.has_blocks:
                assert list(lead(s.group_block_ids)) == cache.req_blocks[s.request_id]
                assert len(lead(s.group_block_ids)) >= cdiv(end, BS)  # (cut chunks keep their blocks)
                for b in lead(s.group_block_ids)[start // BS :]:  # written this step: private and not named
                    assert ref[b] == 1 and tree.page_node[b] is None, (b, s)
            else:
                assert lead(s.group_block_ids) == ()
            if cache.has_states:
                slot = lead(s.group_state_slots, PAD_SLOT_ID)
                assert slot not in (NULL_BLOCK_ID, PAD_SLOT_ID) and slot == cache.running_slot[s.request_id]
                for b, staging in lead(s.group_checkpoints):  # inside the chunk: a staging slot
                    assert start < b < end and b % cache.admission.align == 0
                    assert cache.slots.held[staging] and staging in cache.staging
                    staged.append(staging)
            else:
                assert lead(s.group_state_slots, PAD_SLOT_ID) == PAD_SLOT_ID and lead(s.group_checkpoints) == ()
        assert len(set(staged)) == len(staged) and not set(staged) & running
        assert set(restores) <= running
        saved: list[int] = []
        for slot, pages in out.state_saves:
            assert slot in running or slot in staged
            assert len(pages) == self.k and all(ref[p] == 1 and tree.page_node[p] is None for p in pages)
            assert tree.ckpt_node.get(pages[0]) is None  # not published before the step ran
            saved.extend(pages)
        assert len(set(saved)) == len(saved) and not set(saved) & {b for bs in cache.req_blocks.values() for b in bs}
        assert not set(saved) & fresh

    def check_hit(self, req: Request, hit: int, fresh: set[int], restores: dict[int, tuple[int, ...]]) -> None:
        cache = self.cache
        assert hit <= max(0, req.target_tokens - 1)
        assert hit % BS == 0
        if not self.t.caching:
            assert hit == 0
        if cache.has_states:
            slot = cache.running_slot[req.request_id]
            assert hit % cache.admission.align == 0
            if hit:
                node = cache.tree.nodes[req.block_hashes[hit // BS - 1]]
                assert restores[slot] == node.ckpt and node.tokens == hit
                assert node.ckpt_refs >= 1 and not node.queued[1]  # protected until the copy ran
            else:
                assert slot not in restores
        if cache.has_blocks:
            blocks = cache.req_blocks[req.request_id]
            for i, b in enumerate(blocks[: hit // BS]):
                node = cache.tree.page_node[b]
                assert node is not None and node.hash == req.block_hashes[i] and b not in fresh
            assert set(blocks[hit // BS :]) <= fresh

    def simulate(self, out: SchedulerOutput) -> None:
        sh = self.shadow
        want: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            prefix = tuple(req.all_token_ids[: s.num_computed_tokens])
            want[lead(s.group_state_slots, PAD_SLOT_ID)] = (req.cache_salt, prefix)
        for slot, pages in out.state_restores:  # restores run before the forward: every piece of one checkpoint
            salt, prefix = want[slot]
            assert [sh.page.get(p) for p in pages] == [("state", salt, prefix, i) for i in range(len(pages))], slot
            sh.state[slot] = (salt, prefix)
            self.num_restores += 1
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            toks, salt = tuple(req.all_token_ids), req.cache_salt
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            blocks = lead(s.group_block_ids)
            if self.cache.has_blocks:
                for i, b in enumerate(blocks[: cdiv(start, BS)]):  # what attention reads
                    assert sh.page.get(b) == ("kv", salt, toks[: min(start, (i + 1) * BS)]), (s.request_id, i, b)
                for i in range(start // BS, cdiv(end, BS)):
                    sh.page[blocks[i]] = ("kv", salt, toks[: min(end, (i + 1) * BS)])
            if self.cache.has_states:
                slot = lead(s.group_state_slots, PAD_SLOT_ID)
                if start > 0:  # the state the recurrent layers continue from
                    assert sh.state.get(slot) == (salt, toks[:start]), s.request_id
                for b, staging in lead(s.group_checkpoints):
                    sh.state[staging] = (salt, toks[:b])
                sh.state[slot] = (salt, toks[:end])
        for slot, pages in out.state_saves:  # after the forward: slot -> k pages
            salt, prefix = sh.state[slot]
            for i, p in enumerate(pages):
                sh.page[p] = ("state", salt, prefix, i)
            self.num_saves += 1

    def check_published(self, out: SchedulerOutput) -> None:
        """A saved checkpoint, once published, is named at the block its state ends on."""
        for _, pages in out.state_saves:
            node = self.cache.tree.ckpt_node.get(pages[0])
            if node is not None:
                kind, _, prefix, _ = self.shadow.page[pages[0]]  # type: ignore[misc]
                assert kind == "state" and node.tokens == len(prefix) and node.ckpt == pages  # type: ignore[arg-type]

    def check_hashes(self, advanced: list[Request]) -> None:
        """Every block a step filled is hashed right after it (so it is named and hittable), with the right value."""
        if not (self.t.caching and self.cache.has_blocks):
            return
        for req in advanced:
            expected: list[bytes] = []
            extend_block_hashes(expected, req.all_token_ids, BS, extra_keys(req.cache_salt))
            assert req.block_hashes == expected[: len(req.block_hashes)]
            assert len(req.block_hashes) >= req.num_computed_tokens // BS, req.request_id

    def holders(self) -> list[str]:
        return [r.request_id for r in self.sched.running] + list(self.leased)

    def check_holders(self) -> None:
        """Between steps: ref count == holders; shared pages are cached prefix blocks; slots unique, never 0."""
        cache = self.cache
        holders = self.holders()
        ckpt = checkpoint_pages(cache)
        if cache.has_blocks:
            assert set(cache.req_blocks) == set(holders)
            held = Counter(b for rid in holders for b in cache.req_blocks[rid])
            for b in range(1, cache.pages.num_pages):
                assert cache.pages.ref[b] == (1 if b in ckpt else held[b]), (b, held[b])
                if held[b] > 1:
                    assert cache.tree.page_node[b] is not None, b
                assert not (held[b] and b in ckpt)
        else:
            assert cache.req_blocks == {}
        if cache.has_states:
            assert set(cache.running_slot) == set(holders)
            assert cache.pending == [] and cache.step_pins == [] and cache.staging == []
            slots = [cache.running_slot[rid] for rid in holders]
            assert len(set(slots)) == len(slots) and NULL_BLOCK_ID not in slots
            for b in range(1, cache.slots.num_slots):
                assert cache.slots.held[b] == (b in slots), b
        for node in cache.tree.nodes.values():
            assert not node.ckpt_refs  # no restore or export outlives its step here

    def check_no_leak(self) -> None:
        cache = self.cache
        assert not self.sched.requests and not self.sched.running and not self.sched.waiting
        cache.check_integrity()
        assert cache.num_in_use == 0
        assert len(free_pages(cache)) + len(cached_blocks(cache)) + len(checkpoint_pages(cache)) == cache.pages.capacity
        ckpt = checkpoint_pages(cache)  # a checkpoint's page is held by its node; a cached block by nobody now
        assert cache.pages.ref[1:] == [int(p in ckpt) for p in range(1, cache.pages.num_pages)]
        for stats in cache.pool_stats():  # attention groups count pages (free + cached), recurrent ones slots
            assert stats["in_use"] == 0, stats
            if stats["kind"] == "attention":
                assert stats["free"] + stats["cached"] == stats["total"], stats  # type: ignore[operator]
            else:
                assert stats["free"] == stats["total"] and stats["cached"] == cache.tree.num_checkpoints, stats
        assert cache.req_blocks == {} and cache.num_hashed == {} and cache.running_slot == {}
        assert cache.rolling == {} and cache.superseded == {}
        assert sorted(cache.slots.free) == list(range(1, cache.slots.num_slots))
        assert cache._targets == {} and cache._noted == {}  # per-request admission state freed


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces)
def test_random_traces_keep_every_invariant(trace: Trace) -> None:
    Harness(trace).run()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(4, 24), st.sampled_from([4, 8]), st.sampled_from(["legacy", "reuse-value"]))
def test_tight_pools_preempt_and_still_finish(max_num_seqs: int, budget: int, interval: int, policy: str) -> None:
    """Many requests sharing a prefix on an arena whose pages fit one at a time (its peak, plus one page): preemption
    by recompute must happen and every request still finishes with every invariant."""
    reqs = tuple(
        ReqSpec(0, 16, (i, i + 1, i + 2), 6, None, arrival=0, abort_at=None, prefill_only=False, lease_steps=0)
        for i in range(6)
    )
    trace = Trace("hybrid", interval, max_num_seqs, budget, 0, 1, True, reqs, policy)  # no checkpoint's worth
    h = Harness(trace)
    h.run()
    # chunks shorter than a prompt admit a second request while the first still grows: they cannot both fit
    # (at 14..16 tokens a step, the first prompt's chunks leave the second no room until the first is done)
    if max_num_seqs > 1 and budget <= 12:
        assert h.sched.num_preemptions > 0


def test_shared_prefix_restores_checkpoints_from_the_shared_pages() -> None:
    """The shadow sees restores too: requests arriving one after another on a shared prefix restore checkpoints
    (read back piece by piece from the pages they were saved to), under every policy."""
    reqs = tuple(
        ReqSpec(0, 16, (i, i + 1, i + 2), 3, None, arrival=4 * i, abort_at=None, prefill_only=False, lease_steps=0)
        for i in range(5)
    )
    for kinds in ("hybrid", "recurrent"):
        for policy in ("legacy", "reuse-value", "reuse-lru", "interval-value"):
            h = Harness(Trace(kinds, 8, 1, 24, 6, 2, True, reqs, policy))
            h.run()
            assert h.num_saves > 0 and h.num_restores > 0, (kinds, policy)
            assert sum(r.num_cached_tokens for r in h.reqs.values()) > 0


def test_checkpoint_cap_counts_checkpoints_in_flight() -> None:
    """`max_checkpoints` bounds the cached checkpoints: one request whose chunk saves two (one inside the chunk,
    one at its end) under a cap of 1 must not leave two cached. (The random traces run with caps too.)"""
    reqs = (ReqSpec(0, 8, (), 1, None, arrival=0, abort_at=None, prefill_only=False, lease_steps=0),)
    h = Harness(Trace("recurrent", 4, 1, 64, 4, 2, True, reqs, "legacy", max_checkpoints=1))
    h.run()
    assert h.num_saves >= 1
    assert h.cache.tree.num_checkpoints <= 1, h.cache.tree.num_checkpoints
