"""Several cache groups of each kind: 2 attention groups with different KV shapes and 2 recurrent groups
(Mamba-2 and Gated-DeltaNet states of different shapes), each with its own pool and ids, through the real
Scheduler + HybridCacheManager + engine/transfer.py, with no model.

A producer side (P) and a consumer side (D) each run a scheduler over their own pools; P prefills requests to N-1,
exports them (`export_prefilled`, pinned), D imports them (`begin_import`: the request waits in the scheduler as
WAITING_FOR_TRANSFER holding its destination pages), a fake pull copies what each P page holds into the paired D
page, and then the import completes, fails (pages reusable or quarantined because a READ may still land), is
aborted through the engine's one finish path (`EngineCore.abort`, which asks the transfer canceller), or passes its
deadline (`EngineCore.expire_imports`). Other requests run colocated on D. Pools are tiny, so prefix hits,
eviction and preemption happen all the time.

A shadow device records, per group and page, what a step wrote there (cache salt, token prefix); every read (a block
a chunk attends to, a state a chunk continues from, a restored checkpoint) is checked against what the request needs,
in every group, with its own ids. Aborted or quarantined pages are filled with garbage, so reusing them fails the
check. After every step on both sides: check_integrity() of every pool and of the budget (which also checks that a
rider group names a page only while its leader does), ref counts == holders, and the scheduler never schedules an
importing request. At the end: nothing in use but quarantined pages, nothing left in the schedulers.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.managers import cdiv
from hybridpd.engine.cache.planner import plan_capacity
from hybridpd.engine.cache.specs import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    CacheSpec,
    FullAttentionSpec,
    RecurrentStateSpec,
    group_layers,
)
from hybridpd.engine.cache.tree import CacheTree
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.request import Request, RequestStatus
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerOutput
from hybridpd.engine.structured.matchers import StructuredOutputs
from hybridpd.engine.transfer import (
    Export,
    Import,
    ImportSource,
    abort_import,
    begin_import,
    complete_import,
    export_prefilled,
    release_export,
    schedule_local,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.cache_policies import IntervalAdmission, LruTree
from tests.support.pool_views import own_refs, page_bytes

BS = 4
ATTN_A = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
ATTN_B = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_dim=4, dtype="bfloat16")
MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 2, 4), "float32")
GDN = RecurrentStateSpec("gated_deltanet", (6, 3), "bfloat16", (2, 4, 4), "float32")
LAYOUTS: dict[str, dict[int, CacheSpec]] = {
    "2+2": {0: ATTN_A, 1: MAMBA, 2: ATTN_B, 3: GDN, 4: MAMBA, 5: ATTN_A},
    "2+1": {0: ATTN_A, 1: GDN, 2: ATTN_B},
    "1+2": {0: ATTN_A, 1: MAMBA, 2: GDN},
    "0+2": {0: MAMBA, 1: GDN},
}
PREFIXES = [list(range(1000, 1024)), list(range(2000, 2013)), [5] * 20]
GARBAGE = ("garbage", ())
MAX_MODEL_LEN = 40


def next_token(req: Request) -> int:
    """Deterministic in position (like greedy decoding): equal prefixes continue equally."""
    return (req.num_tokens * 7) % 11


class FakeRunner:
    """What EngineCore's control-plane methods ask of the runner."""

    class _Sampler:
        def forget(self, request_id: str) -> None:
            pass

    def __init__(self) -> None:
        self.sampler = self._Sampler()
        self.zeroed_tails: list[tuple[int, int]] = []

    def zero_block_tail(self, block_id: int, start: int, group_id: int | None = None) -> None:
        self.zeroed_tails.append((block_id, start))


def control_plane_core(cache: HybridCacheManager, scheduler: Scheduler) -> EngineCore:
    """An EngineCore without a model: the finish path, aborts, imports and deadlines are all control plane."""
    core = object.__new__(EngineCore)
    core.cache, core.scheduler, core.runner = cache, scheduler, FakeRunner()  # type: ignore[assignment]
    core.finish_listeners, core.transfer_canceller = [], None
    core.structured = StructuredOutputs(None, 0, (), lambda _: None)  # no constrained requests here
    core.now = 0.0  # type: ignore[attr-defined]
    core.clock = lambda: core.now  # type: ignore[attr-defined]
    return core


@dataclass
class Side:
    """One worker's control plane and the shadow of its device memory: (group id, page) -> (salt, prefix)."""

    name: str
    core: EngineCore
    shadow: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = field(default_factory=dict)
    leased: set[str] = field(default_factory=set)
    """Prefilled requests holding their caches under an export (P)."""
    quarantined_slots: set[tuple[int, int]] = field(default_factory=set)
    """(group, slot) of checkpoint reservations quarantined with a stuck READ (D)."""

    @property
    def cache(self) -> HybridCacheManager:
        return self.core.cache

    @property
    def sched(self) -> Scheduler:
        return self.core.scheduler

    def step(self, pins: Counter[tuple[int, int]]) -> list[Request]:
        importing = set(self.sched.importing)
        out = self.sched.schedule()
        assert not importing & {s.request_id for s in out.seqs}, "an importing request was scheduled"
        self.check_schedule(out)
        self.simulate(out)
        sampled = {s.request_id: (next_token(self.sched.requests[s.request_id]), 0.0) for s in out.seqs if s.sample}
        advanced = self.sched.update_from_output(out, sampled)
        done = []
        for req in advanced:
            if req.compute_target is not None and req.num_computed_tokens >= req.compute_target:
                self.core.finish(req, "prefilled", free_caches=False)
                self.leased.add(req.request_id)  # its caches stay until the export ends
                done.append(req)
            elif len(req.output_token_ids) >= req.sampling_params.max_tokens:
                self.core.finish(req, "length")
        self.check(pins)
        return done

    # -- the device, simulated -----------------------------------------------------------------------------------
    def simulate(self, out: SchedulerOutput) -> None:
        sh = self.shadow
        for gid, copies in out.group_state_copies:  # restores run before the forward
            for src, dst in copies:
                sh[(gid, dst)] = sh[(gid, src)]
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            toks, salt = tuple(req.all_token_ids), req.cache_salt
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for gid, blocks in s.group_block_ids:
                for i, b in enumerate(blocks[: cdiv(start, BS)]):  # what attention reads
                    want = (salt, toks[: min(start, (i + 1) * BS)])
                    assert sh.get((gid, b)) == want, (self.name, s.request_id, gid, i, b)
                for i in range(start // BS, cdiv(end, BS)):
                    sh[(gid, blocks[i])] = (salt, toks[: min(end, (i + 1) * BS)])
            ckpts = dict(s.group_checkpoints)
            for gid, slot in s.group_state_slots:
                if start > 0:  # the state the recurrent layers continue from
                    assert sh.get((gid, slot)) == (salt, toks[:start]), (self.name, s.request_id, gid)
                for b, cslot in ckpts[gid]:
                    sh[(gid, cslot)] = (salt, toks[:b])
                sh[(gid, slot)] = (salt, toks[:end])

    # -- checks ----------------------------------------------------------------------------------------------------
    def check_schedule(self, out: SchedulerOutput) -> None:
        cache = self.cache
        for s in out.seqs:
            assert [g for g, _ in s.group_block_ids] == [m.group.group_id for m in cache.blocks]
            assert [g for g, _ in s.group_state_slots] == [m.group.group_id for m in cache.states]
            for _, blocks in s.group_block_ids:
                assert len(blocks) == cdiv(s.num_computed_tokens + s.num_new_tokens, BS)
            for _, slot in s.group_state_slots:
                assert slot not in (NULL_BLOCK_ID, PAD_SLOT_ID)
            bounds = {tuple(b for b, _ in c) for _, c in s.group_checkpoints}
            assert len(bounds) <= 1, "recurrent groups checkpoint different boundaries"

    def check(self, pins: Counter[tuple[int, int]]) -> None:
        """Integrity, and ref count == holders (requests, quarantine holders, exported checkpoints) per page."""
        cache = self.cache
        cache.check_integrity()
        for m in cache.blocks:
            held = Counter(b for blocks in m.req_blocks.values() for b in blocks)
            for b in range(1, m.pool.num_blocks):
                assert m.pool.ref_cnt[b] == held[b] + own_refs(m.pool, b), (self.name, m.group.group_id, b)
                if held[b] > 1:
                    assert m.pool.block_hash[b] is not None
        reserved = Counter((gid, slot) for imp in self.sched.importing.values() if imp.checkpoint
                           for gid, slot in imp.checkpoint.slots.items())
        for rm in cache.states:
            gid = rm.group.group_id
            assert rm.pending == [] and rm.step_refs == []
            running = list(rm.running_slot.values())
            assert len(set(running)) == len(running)
            for b in range(1, rm.pool.num_blocks):
                want = running.count(b) + pins[(gid, b)] + reserved[(gid, b)] + ((gid, b) in self.quarantined_slots)
                want += own_refs(rm.pool, b)  # the arena's pinned slot
                assert rm.pool.ref_cnt[b] == want, (self.name, gid, b, rm.pool.ref_cnt[b], want)
                if b in running:
                    assert rm.pool.block_hash[b] is None
        holders = set(self.sched.requests) | set(cache.quarantined) | self.leased
        for am in cache.blocks:
            assert set(am.req_blocks) <= holders
        for rm in cache.states:
            assert set(rm.running_slot) <= holders


@dataclass(frozen=True)
class ReqSpec:
    prefix: int
    prefix_len: int
    suffix: tuple[int, ...]
    max_tokens: int
    salt: str | None
    arrival: int
    pd: bool
    outcome: str
    """For a PD request: commit | fail | fail_stuck | abort | abort_stuck | deadline | lease_lost."""
    delay: int
    """Steps the pull takes."""

    def prompt(self) -> list[int]:
        head = PREFIXES[self.prefix][: self.prefix_len] if self.prefix >= 0 else []
        return (head + list(self.suffix) or [3])[: MAX_MODEL_LEN - 10]


req_specs = st.builds(
    ReqSpec,
    prefix=st.sampled_from([0, 0, 0, 1, 2, -1]),
    prefix_len=st.sampled_from([8, 16, 16, 24]) | st.integers(0, 24),
    suffix=st.lists(st.integers(0, 9), max_size=8).map(tuple),
    max_tokens=st.integers(1, 6),
    salt=st.sampled_from([None, None, "t1"]),
    arrival=st.integers(0, 8),
    pd=st.sampled_from([True, True, False]),
    outcome=st.sampled_from(["commit", "commit", "commit", "fail", "fail_stuck", "abort", "abort_stuck",
                             "deadline", "lease_lost"]),
    delay=st.integers(0, 3),
)


@dataclass(frozen=True)
class Trace:
    layout: str
    policy: str
    max_num_seqs: int
    token_budget: int
    spare_bytes: int
    reqs: tuple[ReqSpec, ...]

    def cache_policy(self) -> CachePolicy | None:
        return {"legacy": None, "reuse-value": CachePolicy(), "reuse-lru": CachePolicy(),
                "interval-value": CachePolicy(8)}[self.policy]


traces = st.builds(
    Trace,
    layout=st.sampled_from(["2+2", "2+2", "2+2", "2+1", "1+2", "0+2"]),
    policy=st.sampled_from(["legacy", "reuse-value", "reuse-value", "reuse-lru", "interval-value"]),
    max_num_seqs=st.integers(1, 4),
    token_budget=st.integers(4, 24),
    spare_bytes=st.integers(0, 20000),
    reqs=st.lists(req_specs, min_size=2, max_size=10).map(tuple),
)


def make_side(name: str, trace: Trace) -> Side:
    groups = group_layers(LAYOUTS[trace.layout])
    per_block = page_bytes([g for g in groups if g.is_attention])
    per_state = page_bytes([g for g in groups if not g.is_attention])
    if per_block and per_state:  # one arena: a state slot past the reserved ones is the memory of k whole blocks
        per_state = cdiv(per_state, per_block) * per_block
    need = cdiv(MAX_MODEL_LEN, BS)
    # every request fits alone, next to one quarantined import (a stuck READ keeps its pages for good)
    budget = (2 * need + 1) * per_block + (1 + trace.max_num_seqs + 4 + 4) * per_state + trace.spare_bytes
    plan = plan_capacity(groups, budget, trace.max_num_seqs, 4, MAX_MODEL_LEN, 8, policy=trace.cache_policy())
    lru, interval = trace.policy in ("legacy", "reuse-lru"), trace.policy in ("legacy", "interval-value")
    cache = HybridCacheManager(groups, plan.layout(), tree_cls=LruTree if lru else CacheTree,
                               admission_cls=IntervalAdmission if interval else Admission)
    return Side(name, control_plane_core(cache, Scheduler(SchedulerConfig(trace.max_num_seqs, trace.token_budget),
                                                          cache)))


@dataclass
class Pull:
    req: Request
    exp: Export
    p_req: Request
    imp: Import
    spec: ReqSpec
    due: int
    cancelled: bool = False


class PDHarness:
    def __init__(self, trace: Trace, seed: int = 0) -> None:
        self.t = trace
        self.p, self.d = make_side("P", trace), make_side("D", trace)
        self.exports: dict[str, tuple[Request, Export]] = {}
        self.pulls: dict[str, Pull] = {}
        self.quarantined_pages: set[tuple[int, int]] = set()
        self.rng = random.Random(seed)
        self.step_no = 0
        self.imported = 0
        self.stuck_left = 1
        self.d.core.transfer_canceller = self._cancel

    # -- the fake transport ------------------------------------------------------------------------------------
    def _cancel(self, rid: str) -> bool:
        """D's engine ends an import itself (abort / deadline): reusable unless the spec says the READ is stuck."""
        pull = self.pulls.pop(rid)
        stuck = pull.spec.outcome in ("abort_stuck", "deadline") and self.rng.random() < 0.5 and self._may_stick()
        self._garbage(pull, stuck)
        self._end_export(rid)
        return not stuck

    def _may_stick(self) -> bool:
        """Quarantined pages never come back: at most one stuck READ per trace (the budget has room for it), or tiny
        pools run dry for good."""
        self.stuck_left -= 1
        return self.stuck_left >= 0

    def _garbage(self, pull: Pull, stuck: bool) -> None:
        """An aborted pull may have written part of the pages (or will, if stuck): never to be read again."""
        for maps in (pull.imp.dst_blocks, pull.imp.dst_state_slots):
            for gid, ids in maps.items():
                for b in ids:
                    self.d.shadow[(gid, b)] = GARBAGE
                    if stuck:
                        self.quarantined_pages.add((gid, b))
        if stuck and pull.imp.checkpoint is not None:
            self.d.quarantined_slots.update(pull.imp.checkpoint.slots.items())

    def _copy(self, pull: Pull) -> None:
        for src_map, dst_map in ((pull.imp.src_blocks, pull.imp.dst_blocks),
                                 (pull.imp.src_state_slots, pull.imp.dst_state_slots)):
            for gid, src in src_map.items():
                for s, t in zip(src, dst_map[gid], strict=True):
                    self.d.shadow[(gid, t)] = self.p.shadow[(gid, s)]

    def _end_export(self, rid: str) -> None:
        held = self.exports.pop(rid, None)
        if held is not None:
            release_export(self.p.core, *held)
            self.p.leased.discard(rid)

    def pins(self) -> Counter[tuple[int, int]]:
        return Counter((gid, slot) for _, exp in self.exports.values() if exp.checkpoint
                       for gid, slot in exp.checkpoint.slots.items())

    # -- driving -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        todo = sorted(enumerate(self.t.reqs), key=lambda kv: kv[1].arrival)
        specs: dict[str, ReqSpec] = {}
        while todo or self.p.sched.requests or self.d.sched.requests or self.pulls or self.exports:
            while todo and todo[0][1].arrival <= self.step_no:
                i, spec = todo.pop(0)
                rid, prompt = f"r{i}", spec.prompt()
                specs[rid] = spec
                params = SamplingParams(max_tokens=spec.max_tokens)
                if spec.pd and len(prompt) > 1:
                    self.p.sched.add_request(Request(rid, prompt, params, arrival_index=i, cache_salt=spec.salt,
                                                     compute_target=len(prompt) - 1))
                else:
                    self.d.sched.add_request(Request(rid, prompt, params, arrival_index=i, cache_salt=spec.salt))
            for p_req in self.p.step(self.pins()):  # pins of earlier exports (this step's come after)
                exp = export_prefilled(self.p.core, p_req)
                self.exports[p_req.request_id] = (p_req, exp)
                self._start_import(p_req, exp, specs[p_req.request_id])
            self.p.check(self.pins())
            self._progress_pulls()
            self.d.core.now = float(self.step_no)  # type: ignore[attr-defined]
            self.d.core.expire_imports()
            self.d.check(Counter())
            self.d.step(Counter())
            self.step_no += 1
            assert self.step_no < 800, "no progress"
        self.check_end()

    def _start_import(self, p_req: Request, exp: Export, spec: ReqSpec) -> None:
        d_req = Request(p_req.request_id, list(p_req.prompt_token_ids), SamplingParams(max_tokens=spec.max_tokens),
                        arrival_index=p_req.arrival_index, cache_salt=p_req.cache_salt)
        src = ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint)
        deadline = self.step_no + spec.delay + 0.5 if spec.outcome == "deadline" else None
        imp = begin_import(self.d.core, d_req, src, deadline=deadline)
        if imp is None:  # no room on D now: compute it there
            self._end_export(p_req.request_id)
            schedule_local(self.d.core, d_req)
            return
        assert d_req.status is RequestStatus.WAITING_FOR_TRANSFER and self.d.sched.importing[d_req.request_id] is imp
        for gid, ids in imp.src_blocks.items():  # D reads only what it lacks, in every attention group
            assert ids == exp.blocks[gid][imp.local_hit_tokens // BS:]
        self.pulls[d_req.request_id] = Pull(d_req, exp, p_req, imp, spec, self.step_no + spec.delay)

    def _progress_pulls(self) -> None:
        for rid, pull in list(self.pulls.items()):
            if pull.due > self.step_no or pull.spec.outcome == "deadline":
                continue
            outcome = pull.spec.outcome
            if outcome in ("abort", "abort_stuck"):
                assert self.d.core.abort(rid) is pull.req  # the engine's finish path calls _cancel
                assert pull.req.finish_reason == "abort" and rid not in self.pulls
                continue
            del self.pulls[rid]
            if outcome == "commit":
                self._copy(pull)
                self._end_export(rid)
                complete_import(self.d.core, pull.req)
                self.imported += 1
                assert pull.req.status is RequestStatus.WAITING and pull.req.num_computed_tokens == pull.imp.num_tokens
                continue
            stuck = outcome == "fail_stuck" and self._may_stick()
            self._copy(pull)
            self._garbage(pull, stuck)  # a failed / refused pull: whatever landed is garbage
            self._end_export(rid)
            assert abort_import(self.d.core, pull.req, pull.imp, reusable=not stuck) is (not stuck)
            assert rid not in self.d.sched.requests and rid not in self.d.sched.importing
            schedule_local(self.d.core, pull.req)

    def check_end(self) -> None:
        for side in (self.p, self.d):
            sched = side.sched
            assert not sched.requests and not sched.running and not sched.waiting and not sched.importing
            held = {(g, b) for g, m in ((m.group.group_id, m) for m in side.cache.managers)
                    for holder in side.cache.quarantined
                    for b in m.req_pages(holder)}
            for gid, pool in side.cache.pools.items():
                pool.check_integrity()
                in_use = {b for b in range(1, pool.num_blocks) if pool.ref_cnt[b] > own_refs(pool, b)}
                quarantined = {b for g, b in held | side.quarantined_slots if g == gid}
                assert in_use == quarantined, (side.name, gid, in_use, quarantined)
            for m in side.cache.blocks:
                assert set(m.req_blocks) == set(side.cache.quarantined) and not m.fresh_blocks
            for rm in side.cache.states:
                assert set(rm.running_slot) <= set(side.cache.quarantined) and not rm.copies
            assert side.cache._targets == {} and side.cache._noted == {}
        assert (self.d.cache.quarantined != []) == bool(self.quarantined_pages or self.d.quarantined_slots)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces, st.integers(0, 2**16))
def test_pd_random_traces_with_several_groups_keep_every_invariant(trace: Trace, seed: int) -> None:
    PDHarness(trace, seed).run()


@pytest.mark.parametrize("layout", ["2+2", "2+1", "1+2", "0+2"])
@pytest.mark.parametrize("policy", ["legacy", "reuse-value", "reuse-lru"])
def test_shared_prefix_hits_every_group_and_imports_complete(layout: str, policy: str) -> None:
    """Eight requests sharing a 16-token prefix, half PD: later ones hit the prefix on D (in every group, with each
    group's own ids) and every import completes; the tiny budget forces evictions."""
    reqs = tuple(ReqSpec(0, 16, (i, i + 1, i + 2), 3, None, arrival=i, pd=i % 2 == 0, outcome="commit", delay=i % 3)
                 for i in range(8))
    h = PDHarness(Trace(layout, policy, 2, 16, 4000, reqs))
    h.run()
    assert h.imported == 4
    d = h.d.cache
    assert all(c.hits > 0 for c in d.counters.values()), d.counters
    if policy != "legacy":
        assert d.tree is not None


def test_group_ids_differ_between_groups_and_hits_agree() -> None:
    """The second attention group and the second recurrent group hold different ids than the first ones once one
    group's page was evicted alone is impossible (riders leave with their leader); a hit is the same length in
    every group and names, in every group, pages holding that prefix."""
    reqs = tuple(ReqSpec(0, 20, (i,), 2, None, arrival=2 * i, pd=False, outcome="commit", delay=0)
                 for i in range(6))
    h = PDHarness(Trace("2+2", "reuse-value", 1, 24, 0, reqs))
    h.run()
    d = h.d.cache
    labels = set(d.counters)
    assert labels == {"attention:0", "attention:1", "mamba2", "gated_deltanet"}
    hits = {label: c.hits for label, c in d.counters.items()}
    assert len(set(hits.values())) == 1 and hits["mamba2"] > 0, hits  # every group served the same prefix


def test_waiting_for_transfer_is_never_scheduled_and_frees_everything_on_abort_and_deadline() -> None:
    """Exact states: begin_import holds the pages in WAITING_FOR_TRANSFER; steps run without scheduling it;
    complete_import makes it runnable at num_tokens; abort and deadline give every page back."""
    trace = Trace("2+2", "reuse-value", 2, 16, 40000, ())  # room for every export held at once
    p, d = make_side("P", trace), make_side("D", trace)
    prompt = list(range(1000, 1019))
    pins: Counter[tuple[int, int]] = Counter()
    exports = []
    for i in range(3):
        p.sched.add_request(Request(f"r{i}", prompt if i else prompt[:12], SamplingParams(max_tokens=2),
                                    compute_target=(len(prompt) if i else 12) - 1))
    while p.sched.requests:
        for req in p.step(pins):
            exp = export_prefilled(p.core, req)
            exports.append((req, exp))
            pins.update(exp.checkpoint.slots.items() if exp.checkpoint else ())
        p.check(pins)
    assert exports[1][1].checkpoint is not None  # the 2nd prompt's checkpoint (from the 1st) is exported too
    d.core.transfer_canceller = lambda rid: True
    imps = []
    for req, exp in exports:
        d_req = Request(req.request_id, list(req.prompt_token_ids), SamplingParams(max_tokens=2))
        imp = begin_import(d.core, d_req, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint),
                           deadline=5.0)
        assert imp is not None and set(imp.dst_blocks) == {0, 1} and set(imp.dst_state_slots) == {2, 3}
        assert all(len(ids) == len(imp.dst_state_slots[2]) for ids in imp.dst_state_slots.values())
        imps.append((d_req, imp))
    in_use = {gid: pool.stats()["in_use"] for gid, pool in d.cache.pools.items()}
    assert all(in_use.values()) and not d.core.has_unfinished()
    for _ in range(3):
        assert d.sched.schedule().is_empty  # waiting for transfer: never scheduled
    (r0, i0), (r1, i1), (r2, i2) = imps
    d.shadow.update({(gid, b): ("x", ()) for gid, ids in i0.dst_blocks.items() for b in ids})
    complete_import(d.core, r0)
    assert r0.status is RequestStatus.WAITING and r0.num_computed_tokens == 11 and d.core.has_unfinished()
    assert d.core.abort("r1") is r1 and r1.finish_reason == "abort" and "r1" not in d.sched.importing
    d.core.now = 6.0  # type: ignore[attr-defined]
    assert d.core.expire_imports() == [r2]
    assert r2.status is RequestStatus.WAITING and r2.num_computed_tokens == 0 and r2 in d.sched.waiting
    for req in (r0, r2):
        d.core.finish(req, "abort")
    for req, exp in exports:
        release_export(p.core, req, exp)
    for side in (p, d):
        side.cache.check_integrity()
        assert all(pool.stats()["in_use"] == 0 for pool in side.cache.pools.values())


def test_a_stuck_read_quarantines_every_group_and_the_request_computes_afresh() -> None:
    trace = Trace("2+2", "reuse-value", 2, 16, 40000, ())  # room for every export held at once
    p, d = make_side("P", trace), make_side("D", trace)
    prompt = list(range(2000, 2013))
    p.sched.add_request(Request("r", prompt, SamplingParams(max_tokens=2), compute_target=len(prompt) - 1))
    (req,) = [r for _ in range(10) for r in p.step(Counter())][:1]
    exp = export_prefilled(p.core, req)
    d_req = Request("r", prompt, SamplingParams(max_tokens=2))
    imp = begin_import(d.core, d_req, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
    assert imp is not None
    d.core.transfer_canceller = lambda rid: False  # the READ could not be cancelled
    assert d.core.abort("r") is d_req
    held = {gid: pool.stats()["in_use"] for gid, pool in d.cache.pools.items()}
    assert held[0] == len(imp.dst_blocks[0]) and held[1] == len(imp.dst_blocks[1])
    assert held[2] == len(imp.dst_state_slots[2]) and held[3] == len(imp.dst_state_slots[3])
    assert d.cache.quarantined and not any(m.holds("r") for m in d.cache.managers)
    d.sched.add_request(Request("r", prompt, SamplingParams(max_tokens=2)))  # the same id computes afresh
    while d.sched.requests:
        out = d.sched.schedule()
        for s in out.seqs:
            for gid, blocks in s.group_block_ids:
                assert not set(blocks) & set(imp.dst_blocks[gid]), "a quarantined block was handed out"
            for gid, slot in s.group_state_slots:
                assert slot not in imp.dst_state_slots[gid]
        sampled = {s.request_id: (1, 0.0) for s in out.seqs if s.sample}
        for r in d.sched.update_from_output(out, sampled):
            if r.output_token_ids and len(r.output_token_ids) >= 2:
                d.core.finish(r, "length")
        d.cache.check_integrity()
    release_export(p.core, req, exp)
    p.cache.check_integrity()


def test_transfer_params_carry_every_group() -> None:
    """TransferParams round trip: per attention group blocks, per recurrent group state + checkpoint slots
    (`states`, field 14)."""
    from hybridpd.decode.consumer import source_of
    from hybridpd.engine.transfer import Checkpoint
    from hybridpd.prefill.service import transfer_params
    from hybridpd.proto import hybridpd_pb2 as pb

    exp = Export("r", 11, {0: (3, 4, 5), 1: (7, 8, 9)}, {2: 6, 3: 2}, Checkpoint(8, {2: 4, 3: 5}), {})
    tp = pb.TransferParams.FromString(transfer_params(exp).SerializeToString())
    assert tp.checkpoint_num_tokens == 8 and tp.num_computed_tokens == 11
    src = source_of(tp)
    assert src == ImportSource(11, {0: [3, 4, 5], 1: [7, 8, 9]}, {2: 6, 3: 2}, Checkpoint(8, {2: 4, 3: 5}))


def test_a_failed_step_leaves_imports_waiting_and_a_fail_deadline_ends_them_with_an_error() -> None:
    trace = Trace("2+2", "reuse-value", 2, 16, 40000, ())
    p, d = make_side("P", trace), make_side("D", trace)
    prompt = list(range(2000, 2013))
    p.sched.add_request(Request("r", prompt, SamplingParams(max_tokens=2), compute_target=len(prompt) - 1))
    (req,) = [r for _ in range(10) for r in p.step(Counter())][:1]
    exp = export_prefilled(p.core, req)
    d.sched.add_request(Request("other", prompt, SamplingParams(max_tokens=2)))
    d_req = Request("r", prompt, SamplingParams(max_tokens=2))
    imp = begin_import(d.core, d_req, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint),
                       deadline=3.0, fallback="fail")
    assert imp is not None
    ended: list[str] = []
    d.core.finish_listeners.append(lambda r: ended.append(f"{r.request_id}:{r.finish_reason}"))
    d.core.fail_all("injected")
    assert ended == ["other:error"] and d_req.status is RequestStatus.WAITING_FOR_TRANSFER
    d.core.now = 3.0  # type: ignore[attr-defined]
    assert d.core.expire_imports() == [d_req]
    assert ended == ["other:error", "r:error"] and d_req.stop_reason == "transfer deadline passed"
    assert not d.sched.requests and all(pool.stats()["in_use"] == 0 for pool in d.cache.pools.values())
    d.cache.check_integrity()
    release_export(p.core, req, exp)
