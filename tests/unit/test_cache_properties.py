"""Property tests: random traces through Scheduler + HybridCacheManager with no model, on pools small enough that
preemption, eviction and chunking happen all the time.

A shadow model stands in for the device: it records what each attention block and each state slot holds, as
(cache_salt, token prefix), when a step writes it, and checks every read against what the request needs. So a hit
on a wrong, evicted or overwritten block, a checkpoint restored into the wrong slot, or a shared block being
written, fails here even when ref counts look fine.

Each trace runs one cache policy: the pre-v2 layout (fixed-interval checkpoints, separate LRU pools), or one byte
budget shared by blocks and checkpoints with reuse admission (branch points, prompt ends, rolling request ends)
and value or LRU eviction, at budgets tight enough that blocks and states evict each other.

After every step: every pool's check_integrity() (and the budget's); ref count == holders for every block and slot;
blocks held by two requests are cached prefix blocks; running slots unique and never 0; the fresh-block list and
the copy list are drained by schedule(). At the end: no leak (in_use == 0, free + cached == total).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.hashing import extra_keys
from hybridpd.engine.cache.managers import cdiv
from hybridpd.engine.cache.specs import NULL_BLOCK_ID, PAD_SLOT_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.cache.tree import CacheTree
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerOutput
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.cache_policies import IntervalAdmission, LruTree
from tests.support.pool_views import extend_block_hashes

BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
GDN = RecurrentStateSpec("gated_deltanet", (6, 3), "bfloat16", (2, 4, 4), "float32")
PREFIXES = [list(range(1000, 1024)), list(range(2000, 2013)), [5] * 20]  # shared prefixes (one repetitive)

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
    spare_blocks: int
    caching: bool
    reqs: tuple[ReqSpec, ...]
    policy: str = "legacy"
    """legacy | reuse-value | reuse-lru | interval-value"""
    spare_bytes: int = 0
    """One budget: bytes beyond what max_num_seqs running states and the largest request need."""

    def cache_policy(self) -> CachePolicy | None:
        if self.policy == "legacy":
            return None
        return CachePolicy(self.interval if self.policy.startswith("interval") else 0)

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
)


def next_token(req: Request) -> int:
    """Deterministic in position (like greedy decoding): equal prefixes continue equally."""
    return (req.num_tokens * 7) % 11


class Shadow:
    """What the device would hold: attention block -> (salt, prefix written), state slot -> (salt, prefix)."""

    def __init__(self) -> None:
        self.attn: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.state: dict[int, tuple[str | None, tuple[int, ...]]] = {}


class Harness:
    def __init__(self, trace: Trace) -> None:
        self.t = trace
        groups = {
            "hybrid": [CacheGroup(0, ATTN, (0, 3)), CacheGroup(1, GDN, (1, 2, 4))],
            "attention": [CacheGroup(0, ATTN, (0, 1))],
            "recurrent": [CacheGroup(0, GDN, (0, 1))],
        }[trace.kinds]
        need = max(r.max_blocks() for r in trace.reqs)
        budget = None
        if trace.policy != "legacy":
            per_block = sum(g.page_bytes_all_layers for g in groups if g.is_attention)
            per_state = sum(g.page_bytes_all_layers for g in groups if not g.is_attention)
            budget = need * per_block + trace.max_num_seqs * per_state + trace.spare_bytes
        layout = PoolLayout(
            attention_blocks=1 + need + trace.spare_blocks,
            state_slots=1 + trace.max_num_seqs + trace.checkpoint_slots,
            checkpoint_interval=trace.interval,
            block_size=BS,
            budget_bytes=budget,
            policy=trace.cache_policy(),
        )
        self.cache = HybridCacheManager(groups, layout, enable_prefix_caching=trace.caching, tree_cls=trace.tree_cls,
                                        admission_cls=trace.admission_cls)
        self.sched = Scheduler(SchedulerConfig(trace.max_num_seqs, trace.budget), self.cache)
        self.shadow = Shadow()
        self.leased: dict[str, tuple[Request, int]] = {}  # finished prefill-only requests holding caches
        self.reqs: dict[str, Request] = {}
        self.step_no = 0

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
            self.check_holders()
            self.one_step()
            self.step_no += 1
            assert self.step_no < 600, "no progress"
        self.check_no_leak()

    def one_step(self) -> None:
        waiting = {r.request_id for r in self.sched.waiting}
        out = self.sched.schedule()
        assert all(not v for v in self.cache.take_group_fresh_blocks().values())
        assert all(not v for v in self.cache.take_group_state_copies().values())
        self.check_schedule(out, waiting)
        self.simulate(out)
        sampled = {
            s.request_id: (next_token(self.sched.requests[s.request_id]), 0.0) for s in out.seqs if s.sample
        }
        advanced = self.sched.update_from_output(out, sampled)
        for req in advanced:
            spec = self.t.reqs[req.arrival_index]
            if req.compute_target is not None and req.num_computed_tokens >= req.compute_target:
                self.sched.finish(req, "prefilled", free_caches=False)
                self.leased[req.request_id] = (req, self.step_no + spec.lease_steps)
            elif len(req.output_token_ids) >= req.sampling_params.max_tokens:
                self.sched.finish(req, "length")
        self.cache.check_integrity()
        self.check_holders()
        self.check_hashes(advanced)

    # -- checks ----------------------------------------------------------------------------------------------------
    def check_schedule(self, out: SchedulerOutput, waiting: set[str]) -> None:
        assert sum(s.num_new_tokens for s in out.seqs) <= self.t.budget
        assert len(self.sched.running) <= self.t.max_num_seqs
        ids = [s.request_id for s in out.seqs]
        assert len(ids) == len(set(ids))
        attn, rec = self.cache.attention, self.cache.recurrent
        fresh = set(lead(out.group_fresh_blocks))
        assert len(fresh) == len(lead(out.group_fresh_blocks))
        if attn is not None:
            for b in fresh:
                assert b != NULL_BLOCK_ID and attn.pool.ref_cnt[b] == 1 and attn.pool.block_hash[b] is None
        copies = dict((dst, src) for src, dst in lead(out.group_state_copies))
        ckpt_slots: list[int] = []
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            assert 0 < s.num_new_tokens and end <= req.target_tokens
            assert s.token_ids == tuple(req.all_token_ids[start:end])
            admitted = s.request_id in waiting
            if admitted:
                self.check_hit(req, s, start, fresh, copies)
            else:
                assert lead(s.group_state_slots, PAD_SLOT_ID) not in copies
            if attn is not None:
                assert list(lead(s.group_block_ids)) == attn.req_blocks[s.request_id]
                assert len(lead(s.group_block_ids)) == cdiv(end, BS)
                for b in lead(s.group_block_ids)[start // BS :]:  # written this step: private and not named
                    assert attn.pool.ref_cnt[b] == 1 and attn.pool.block_hash[b] is None, (b, s)
            else:
                assert lead(s.group_block_ids) == ()
            if rec is not None:
                assert lead(s.group_state_slots, PAD_SLOT_ID) not in (NULL_BLOCK_ID, PAD_SLOT_ID)
                for b, slot in lead(s.group_checkpoints):
                    assert start < b <= end and b % self.cache.admission.align == 0
                    assert rec.pool.ref_cnt[slot] == 1 and rec.pool.block_hash[slot] is None
                    ckpt_slots.append(slot)
            else:
                assert lead(s.group_state_slots, PAD_SLOT_ID) == PAD_SLOT_ID and lead(s.group_checkpoints) == ()
        running = [slot for r in self.sched.running for slot in self.cache.group_state_slots(r.request_id).values()]
        assert len(set(ckpt_slots)) == len(ckpt_slots) and not set(ckpt_slots) & set(running)
        assert set(copies) <= set(running)

    def check_hit(
        self, req: Request, s: object, hit: int, fresh: set[int], copies: dict[int, int]
    ) -> None:
        attn, rec = self.cache.attention, self.cache.recurrent
        assert hit <= max(0, req.target_tokens - 1)
        assert hit % BS == 0
        if not self.t.caching:
            assert hit == 0
        slot = lead(tuple(self.cache.group_state_slots(req.request_id).items()), PAD_SLOT_ID)
        if rec is not None:
            assert hit % self.cache.admission.align == 0
            if hit:
                src = copies[slot]
                assert rec.pool.block_hash[src] == req.block_hashes[hit // BS - 1]
                assert rec.pool.ref_cnt[src] >= 1  # protected until the copy ran
            else:
                assert slot not in copies
        if attn is not None:
            blocks = attn.req_blocks[req.request_id]
            for i, b in enumerate(blocks[: hit // BS]):
                assert attn.pool.block_hash[b] == req.block_hashes[i] and b not in fresh
            assert set(blocks[hit // BS :]) <= fresh

    def simulate(self, out: SchedulerOutput) -> None:
        sh = self.shadow
        for src, dst in lead(out.group_state_copies):  # copies run before the forward
            sh.state[dst] = sh.state[src]
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            toks, salt = tuple(req.all_token_ids), req.cache_salt
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if self.cache.attention is not None:
                for i, b in enumerate(lead(s.group_block_ids)[: cdiv(start, BS)]):  # what attention reads
                    assert sh.attn.get(b) == (salt, toks[: min(start, (i + 1) * BS)]), (s.request_id, i, b)
                for i in range(start // BS, cdiv(end, BS)):
                    sh.attn[lead(s.group_block_ids)[i]] = (salt, toks[: min(end, (i + 1) * BS)])
            if self.cache.recurrent is not None:
                if start > 0:  # the state the recurrent layers continue from
                    assert sh.state.get(lead(s.group_state_slots, PAD_SLOT_ID)) == (salt, toks[:start]), s.request_id
                for b, slot in lead(s.group_checkpoints):
                    sh.state[slot] = (salt, toks[:b])
                sh.state[lead(s.group_state_slots, PAD_SLOT_ID)] = (salt, toks[:end])

    def check_hashes(self, advanced: list[Request]) -> None:
        """Every block a step filled is hashed right after it (so it is named and hittable), with the right value."""
        if not (self.t.caching and self.cache.attention is not None):
            return
        for req in advanced:
            expected: list[bytes] = []
            extend_block_hashes(expected, req.all_token_ids, BS, extra_keys(req.cache_salt))
            assert req.block_hashes == expected[: len(req.block_hashes)]
            assert len(req.block_hashes) >= req.num_computed_tokens // BS, req.request_id

    def holders(self) -> list[str]:
        return [r.request_id for r in self.sched.running] + list(self.leased)

    def check_holders(self) -> None:
        """Between steps: ref count == holders; shared blocks are cached prefix blocks; slots unique, never 0."""
        attn, rec = self.cache.attention, self.cache.recurrent
        holders = self.holders()
        if attn is not None:
            assert set(attn.req_blocks) == set(holders)
            held = Counter(b for rid in holders for b in attn.req_blocks[rid])
            for b in range(1, attn.pool.num_blocks):
                assert attn.pool.ref_cnt[b] == held[b], (b, held[b])
                if held[b] > 1:
                    assert attn.pool.block_hash[b] is not None, b
        if rec is not None:
            assert set(rec.running_slot) == set(holders)
            assert rec.pending == [] and rec.step_refs == []
            slots = [rec.running_slot[rid] for rid in holders]
            assert len(set(slots)) == len(slots) and NULL_BLOCK_ID not in slots
            for b in range(1, rec.pool.num_blocks):
                assert rec.pool.ref_cnt[b] == (1 if b in slots else 0), b
                if b in slots:
                    assert rec.pool.block_hash[b] is None  # running slots are never named

    def check_no_leak(self) -> None:
        assert not self.sched.requests and not self.sched.running and not self.sched.waiting
        for pool in self.cache.pools.values():
            pool.check_integrity()
            st_ = pool.stats()
            assert st_["in_use"] == 0 and st_["free"] + st_["cached"] == st_["total"], (pool.name, st_)
        if self.cache.attention is not None:
            assert self.cache.attention.req_blocks == {} and self.cache.attention.num_hashed == {}
        if self.cache.recurrent is not None:
            assert self.cache.recurrent.running_slot == {}
            assert self.cache.recurrent.rolling == {} and self.cache.recurrent.superseded == {}
        assert self.cache._targets == {} and self.cache._noted == {}  # per-request admission state freed


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces)
def test_random_traces_keep_every_invariant(trace: Trace) -> None:
    Harness(trace).run()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(4, 24), st.sampled_from([4, 8]), st.sampled_from(["legacy", "reuse-value"]))
def test_tight_pools_preempt_and_still_finish(max_num_seqs: int, budget: int, interval: int, policy: str) -> None:
    """Many requests sharing a prefix on a pool that fits one at a time: preemption by recompute must happen and
    every request still finishes with every invariant."""
    reqs = tuple(
        ReqSpec(0, 16, (i, i + 1, i + 2), 6, None, arrival=0, abort_at=None, prefill_only=False, lease_steps=0)
        for i in range(6)
    )
    trace = Trace("hybrid", interval, max_num_seqs, budget, 2, 1, True, reqs, policy)
    h = Harness(trace)
    h.run()
    if max_num_seqs > 1 and budget >= 8 and policy == "legacy":  # reuse shares the prefix's blocks: may fit
        assert h.sched.num_preemptions > 0
