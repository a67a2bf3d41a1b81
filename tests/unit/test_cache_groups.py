"""Several cache groups of each kind: 2 attention groups with different KV shapes and 2 recurrent groups
(Mamba-2 and Gated-DeltaNet states of different shapes) on the page arena (engine/cache/arena.py: page j holds block j
of every attention group, a slot one state of every recurrent group, a checkpoint k pages), so every attention group
gets the same block table and every recurrent group the same slot, through the real Scheduler + HybridCacheManager +
engine/transfer.py, with no model.

A producer side (P) and a consumer side (D) each run a scheduler over their own pools; P prefills requests to N-1,
exports them (`export_prefilled`, pinned), D imports them (`begin_import`: the request waits in the scheduler as
WAITING_FOR_TRANSFER holding its destination pages), a fake pull copies what each P page holds into the paired D
page, and then the import completes, fails (pages reusable or quarantined because a READ may still land), is
aborted through the engine's one finish path (`EngineCore.abort`, which asks the transfer canceller), or passes its
deadline (`EngineCore.expire_imports`). Other requests run colocated on D. Pools are tiny, so prefix hits,
eviction and preemption happen all the time.

A shadow device records, per page and slot, what a step wrote there (cache salt, token prefix; a checkpoint's page
holds one k-th of a state): restores before the forward, the forward, saves after it, and a pull's copies (a
checkpoint travels as pages read like blocks). Every read (a block a chunk attends to, a state a chunk continues
from, a restored checkpoint) is checked against what the request needs, in every group, through that group's ids;
every group of a kind must get the same ids. Aborted or quarantined pages are filled with garbage, so reusing them
fails the check. After every step on both sides: check_integrity(), ref counts == holders (requests, quarantine
holders; a checkpoint's page is held by its node, a pending save or a transfer's reservation), exported checkpoints
pinned, and the scheduler never schedules an importing request. At the end: nothing in use but quarantined pages,
nothing left in the schedulers.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.planner import CapacityPlan, plan_capacity
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
from tests.support.pool_views import cached_blocks, checkpoint_pages, page_bytes

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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


def control_plane_core(cache: HybridCacheManager, scheduler: Scheduler, plan: CapacityPlan) -> EngineCore:
    """An EngineCore without a model: the finish path, aborts, imports and deadlines are all control plane. One rank
    (`tp` None) with the plan's arena: checkpoints travel in a handoff where its pages are exactly the blocks."""
    core = object.__new__(EngineCore)
    core.cache, core.scheduler, core.runner = cache, scheduler, FakeRunner()  # type: ignore[assignment]
    core.tp, core.plan = None, plan  # type: ignore[assignment]
    core.finish_listeners, core.transfer_canceller = [], None
    core.structured = StructuredOutputs(None, 0, (), lambda _: None)  # no constrained requests here
    core.now = 0.0  # type: ignore[attr-defined]
    core.clock = lambda: core.now  # type: ignore[attr-defined]
    return core


@dataclass
class Side:
    """One worker's control plane and the shadow of its device memory: page -> ("kv", salt, prefix) or ("state",
    salt, prefix, i) (piece i of a checkpoint), slot -> ("slot", salt, prefix)."""

    name: str
    core: EngineCore
    page: dict[int, tuple[object, ...]] = field(default_factory=dict)
    slot: dict[int, tuple[object, ...]] = field(default_factory=dict)
    leased: set[str] = field(default_factory=set)
    """Prefilled requests holding their caches under an export (P)."""
    quarantined_ckpt: set[int] = field(default_factory=set)
    """Pages of checkpoint reservations quarantined with a stuck READ (D)."""

    @property
    def cache(self) -> HybridCacheManager:
        return self.core.cache

    @property
    def sched(self) -> Scheduler:
        return self.core.scheduler

    def step(self, pins: Counter[tuple[int, ...]]) -> list[Request]:
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
        want = {}
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            for _, slot in s.group_state_slots:
                want[slot] = (req.cache_salt, tuple(req.all_token_ids[: s.num_computed_tokens]))
        for slot, pages in out.state_restores:  # restores run before the forward: every group's state at once
            salt, prefix = want[slot]
            got = [self.page.get(p) for p in pages]
            assert got == [("state", salt, prefix, i) for i in range(len(pages))], (self.name, slot, got)
            self.slot[slot] = ("slot", salt, prefix)
        for s in out.seqs:
            req = self.sched.requests[s.request_id]
            toks, salt = tuple(req.all_token_ids), req.cache_salt
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for gid, blocks in s.group_block_ids:  # every group reads through its own ids (before any writes)
                for i, b in enumerate(blocks[: cdiv(start, BS)]):  # what attention reads
                    want_kv = ("kv", salt, toks[: min(start, (i + 1) * BS)])
                    assert self.page.get(b) == want_kv, (self.name, s.request_id, gid, i, b, self.page.get(b))
            for gid, slot in s.group_state_slots:
                if start > 0:  # the state the recurrent layers continue from
                    assert self.slot.get(slot) == ("slot", salt, toks[:start]), (self.name, s.request_id, gid)
            for _, blocks in s.group_block_ids:  # ... and writes
                for i in range(start // BS, cdiv(end, BS)):
                    self.page[blocks[i]] = ("kv", salt, toks[: min(end, (i + 1) * BS)])
            ckpts = dict(s.group_checkpoints)
            for gid, slot in s.group_state_slots:
                for b, staging in ckpts[gid]:
                    self.slot[staging] = ("slot", salt, toks[:b])
                self.slot[slot] = ("slot", salt, toks[:end])
        for slot, pages in out.state_saves:  # after the forward: a slot's state to k pages
            _, salt, prefix = self.slot[slot]
            for i, p in enumerate(pages):
                self.page[p] = ("state", salt, prefix, i)

    # -- checks ----------------------------------------------------------------------------------------------------
    def check_schedule(self, out: SchedulerOutput) -> None:
        cache = self.cache
        assert [g for g, _ in out.group_fresh_blocks] == cache.attention_groups
        assert len({ids for _, ids in out.group_fresh_blocks}) <= 1, "groups got different fresh pages"
        for s in out.seqs:
            assert [g for g, _ in s.group_block_ids] == cache.attention_groups
            assert [g for g, _ in s.group_state_slots] == cache.recurrent_groups
            assert len({ids for _, ids in s.group_block_ids}) <= 1, "attention groups got different block tables"
            assert len({slot for _, slot in s.group_state_slots}) <= 1, "recurrent groups got different slots"
            assert len({c for _, c in s.group_checkpoints}) <= 1, "recurrent groups got different checkpoints"
            for _, blocks in s.group_block_ids:
                assert len(blocks) >= cdiv(s.num_computed_tokens + s.num_new_tokens, BS)  # (cut chunks keep theirs)
                assert list(blocks) == cache.req_blocks[s.request_id]
            for _, slot in s.group_state_slots:
                assert slot not in (NULL_BLOCK_ID, PAD_SLOT_ID) and slot == cache.running_slot[s.request_id]
        for slot, pages in (*out.state_restores, *out.state_saves):
            assert len(pages) == cache.k and slot

    def check(self, pins: Counter[tuple[int, ...]]) -> None:
        """Integrity, and ref count == holders per page (requests and quarantine holders listing it; a checkpoint's
        page, an import's reservation or a quarantined one: 1), exported checkpoints pinned, slots held == running."""
        cache = self.cache
        cache.check_integrity()
        held = Counter(b for blocks in cache.req_blocks.values() for b in blocks)
        reserved = {p for imp in self.sched.importing.values() if imp.checkpoint for p in imp.checkpoint.pages}
        ckpt = checkpoint_pages(cache)
        alone = ckpt | reserved | self.quarantined_ckpt  # held once, by no request
        assert not ckpt & reserved and not ckpt & self.quarantined_ckpt
        for b in range(1, cache.pages.num_pages):
            assert cache.pages.ref[b] == (1 if b in alone else held[b]), (self.name, b, cache.pages.ref[b], held[b])
            if held[b] > 1:
                assert cache.tree.page_node[b] is not None
            assert not (held[b] and b in alone)
        assert cache.pending == [] and cache.step_pins == [] and cache.staging == []
        for node in cache.tree.nodes.values():
            want = pins[node.ckpt] if node.ckpt is not None else 0
            assert node.ckpt_refs == want, (self.name, node.ckpt, node.ckpt_refs, want)
        running = list(cache.running_slot.values())
        assert len(set(running)) == len(running)
        assert {s for s in range(1, cache.slots.num_slots) if cache.slots.held[s]} == set(running)
        holders = set(self.sched.requests) | set(cache.quarantined) | self.leased
        assert set(cache.req_blocks) <= holders and set(cache.running_slot) <= holders


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

    def cache_policy(self) -> CachePolicy:
        return {"legacy": CachePolicy(8), "reuse-value": CachePolicy(), "reuse-lru": CachePolicy(),
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
    attn = [g for g in groups if g.is_attention]
    page = page_bytes(attn) if attn else page_bytes(groups)
    k = cdiv(page_bytes([g for g in groups if not g.is_attention]), page)
    need = cdiv(MAX_MODEL_LEN, BS)
    # every request fits alone, next to one quarantined import (a stuck READ keeps its pages for good), with room
    # for a few checkpoints
    slots = 1 + trace.max_num_seqs + STAGING_SLOTS
    budget = (slots * k + 1 + 2 * need + 1 + 4 * k) * page + trace.spare_bytes
    plan = plan_capacity(groups, budget, trace.max_num_seqs, 4, MAX_MODEL_LEN, 8, policy=trace.cache_policy(),
                         block_size=BS)
    assert plan.arena is not None and plan.arena.num_slots == slots and plan.arena.pages_per_state == k
    lru, interval = trace.policy in ("legacy", "reuse-lru"), trace.policy in ("legacy", "interval-value")
    cache = HybridCacheManager(groups, plan.layout(), tree_cls=LruTree if lru else CacheTree,
                               admission_cls=IntervalAdmission if interval else Admission)
    sched = Scheduler(SchedulerConfig(trace.max_num_seqs, trace.token_budget), cache)
    return Side(name, control_plane_core(cache, sched, plan))


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
        self.quarantined_pages: set[int] = set()
        self.quarantined_slots: set[int] = set()
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
        imp = pull.imp
        pages = {b for ids in imp.read_blocks()[1].values() for b in ids}
        if imp.checkpoint is not None:
            pages |= set(imp.checkpoint.pages)
        slots = {b for ids in imp.dst_state_slots.values() for b in ids}
        for b in pages:
            self.d.page[b] = GARBAGE
        for b in slots:
            self.d.slot[b] = GARBAGE
        if stuck:
            self.quarantined_pages |= pages
            self.quarantined_slots |= slots
            if imp.checkpoint is not None:
                self.d.quarantined_ckpt |= set(imp.checkpoint.pages)

    def _copy(self, pull: Pull) -> None:
        """The READs: each attention group's blocks (and the checkpoint's pages, read like blocks), every recurrent
        group's running state. Every group of a kind names the same pages."""
        src, dst = pull.imp.read_blocks()
        assert len({tuple(ids) for ids in src.values()}) <= 1 and len({tuple(ids) for ids in dst.values()}) <= 1
        for gid, ids in src.items():
            for a, b in zip(ids, dst[gid], strict=True):
                self.d.page[b] = self.p.page[a]
        for gid, ids in pull.imp.src_state_slots.items():
            for a, b in zip(ids, pull.imp.dst_state_slots[gid], strict=True):
                self.d.slot[b] = self.p.slot[a]

    def _end_export(self, rid: str) -> None:
        held = self.exports.pop(rid, None)
        if held is not None:
            release_export(self.p.core, *held)
            self.p.leased.discard(rid)

    def pins(self) -> Counter[tuple[int, ...]]:
        """Exported checkpoints (their pages) -> how many exports pin them."""
        return Counter(exp.checkpoint.pages for _, exp in self.exports.values() if exp.checkpoint)

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
        if imp.checkpoint is not None:  # a checkpoint travels as k pages, read like blocks
            assert exp.checkpoint is not None and imp.src_checkpoint_pages == exp.checkpoint.pages
            assert imp.checkpoint.num_tokens == exp.checkpoint.num_tokens
            assert len(imp.checkpoint.pages) == self.d.cache.k
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
            sched, cache = side.sched, side.cache
            assert not sched.requests and not sched.running and not sched.waiting and not sched.importing
            assert set(cache.req_blocks) == set(cache.quarantined) or not cache.has_blocks
            assert set(cache.running_slot) <= set(cache.quarantined)
            cache.check_integrity()
            ckpt = checkpoint_pages(cache)
            in_use = {b for b in range(1, cache.pages.num_pages) if cache.pages.ref[b] and b not in ckpt}
            quarantined = {b for blocks in cache.req_blocks.values() for b in blocks} | side.quarantined_ckpt
            assert in_use == quarantined, (side.name, in_use, quarantined)
            held = {s for s in range(1, cache.slots.num_slots) if cache.slots.held[s]}
            assert held == set(cache.running_slot.values()), (side.name, held)
            free = set(cache.pages.free)  # a quarantined hit block may be cached (named) too
            assert not free & (in_use | ckpt | cached_blocks(cache)) and not ckpt & (in_use | cached_blocks(cache))
            assert len(free | in_use | ckpt | cached_blocks(cache)) == cache.pages.capacity
            assert not cache.fresh and not cache.restores and not cache.saves and not cache.pending
            assert cache._targets == {} and cache._noted == {}
        stuck = self.quarantined_pages or self.quarantined_slots
        assert (self.d.cache.quarantined != []) == bool(stuck)
        if self.d.cache.quarantined:  # what a stuck READ may write is held for good
            d = self.d.cache
            held_pages = {b for blocks in d.req_blocks.values() for b in blocks} | self.d.quarantined_ckpt
            assert self.quarantined_pages <= held_pages
            assert self.quarantined_slots <= set(d.running_slot.values())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces, st.integers(0, 2**16))
def test_pd_random_traces_with_several_groups_keep_every_invariant(trace: Trace, seed: int) -> None:
    PDHarness(trace, seed).run()


def in_use(cache: HybridCacheManager) -> dict[int, int]:
    """Group id -> ids requests hold (attention groups: pages, recurrent groups: slots), from `pool_stats`."""
    return {int(st_["group_id"]): int(st_["in_use"]) for st_ in cache.pool_stats()}  # type: ignore[call-overload]


@pytest.mark.parametrize("layout", ["2+2", "2+1", "1+2", "0+2"])
@pytest.mark.parametrize("policy", ["legacy", "reuse-value", "reuse-lru"])
def test_shared_prefix_hits_every_group_and_imports_complete(layout: str, policy: str) -> None:
    """Eight requests sharing a 16-token prefix, half PD: later ones hit the prefix on D (in every group, through
    the same ids) and every import completes; the tiny budget forces evictions."""
    reqs = tuple(ReqSpec(0, 16, (i, i + 1, i + 2), 3, None, arrival=i, pd=i % 2 == 0, outcome="commit", delay=i % 3)
                 for i in range(8))
    h = PDHarness(Trace(layout, policy, 2, 16, 4000, reqs))
    h.run()
    assert h.imported == 4
    d = h.d.cache
    assert all(c.hits > 0 for c in d.counters.values()), d.counters


def test_every_group_of_a_kind_gets_the_same_ids_and_the_same_events() -> None:
    """Groups of one kind share one block table (attention) or one slot (recurrent) per request: a hit is the same
    length in every group, and the cache-event stream reports the same stored / removed hashes for every group of a
    kind (a block's page, a checkpoint's pages, are one entry for all of them)."""
    reqs = tuple(ReqSpec(0, 20, (i,), 2, None, arrival=2 * i, pd=i % 2 == 1, outcome="commit", delay=0)
                 for i in range(6))
    h = PDHarness(Trace("2+2", "reuse-value", 1, 24, 0, reqs))
    events: dict[str, list[tuple[int, bool, bytes]]] = {"P": [], "D": []}
    steps = h.d.step

    def step_and_drain(pins: Counter[tuple[int, ...]]) -> list[Request]:
        done = steps(pins)
        for side in (h.p, h.d):
            events[side.name] += [(e.group, e.stored, e.block_hash) for e in side.cache.events.drain_from()[1]]
        return done

    h.d.step = step_and_drain  # type: ignore[method-assign]
    h.run()
    d = h.d.cache
    assert d.attention_groups == [0, 1] and d.recurrent_groups == [2, 3]
    labels = set(d.counters)
    assert labels == {"attention:0", "attention:1", "mamba2", "gated_deltanet"}
    hits = {label: c.hits for label, c in d.counters.items()}
    assert len(set(hits.values())) == 1 and hits["mamba2"] > 0, hits  # every group served the same prefix
    for name, evs in events.items():
        by_group = {g: [(stored, hsh) for gg, stored, hsh in evs if gg == g] for g in range(4)}
        assert by_group[0] == by_group[1] and by_group[2] == by_group[3], name
        assert by_group[0] and by_group[2], name  # blocks and checkpoints were stored
    for side in (h.p, h.d):
        snap = side.cache.cached_hashes()
        assert snap[0] == snap[1] and snap[2] == snap[3]


def test_waiting_for_transfer_is_never_scheduled_and_frees_everything_on_abort_and_deadline() -> None:
    """Exact states: begin_import holds the pages in WAITING_FOR_TRANSFER; steps run without scheduling it;
    complete_import makes it runnable at num_tokens; abort and deadline give every page back."""
    trace = Trace("2+2", "reuse-value", 2, 16, 40000, ())  # room for every export held at once
    p, d = make_side("P", trace), make_side("D", trace)
    prompt = list(range(1000, 1019))
    pins: Counter[tuple[int, ...]] = Counter()
    exports = []
    for i in range(3):
        p.sched.add_request(Request(f"r{i}", prompt if i else prompt[:12], SamplingParams(max_tokens=2),
                                    compute_target=(len(prompt) if i else 12) - 1))
    while p.sched.requests:
        for req in p.step(pins):
            exp = export_prefilled(p.core, req)
            exports.append((req, exp))
            if exp.checkpoint:
                pins[exp.checkpoint.pages] += 1
        p.check(pins)
    assert exports[1][1].checkpoint is not None  # the 2nd prompt's checkpoint (from the 1st) is exported too
    assert len(exports[1][1].checkpoint.pages) == p.cache.k
    d.core.transfer_canceller = lambda rid: True
    imps = []
    for req, exp in exports:
        d_req = Request(req.request_id, list(req.prompt_token_ids), SamplingParams(max_tokens=2))
        imp = begin_import(d.core, d_req, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint),
                           deadline=5.0)
        assert imp is not None and set(imp.dst_blocks) == {0, 1} and set(imp.dst_state_slots) == {2, 3}
        assert imp.dst_blocks[0] == imp.dst_blocks[1] and imp.dst_state_slots[2] == imp.dst_state_slots[3]
        imps.append((d_req, imp))
    assert all(in_use(d.cache).values()) and not d.core.has_unfinished()
    assert any(imp.checkpoint is not None for _, imp in imps)  # a checkpoint's pages were reserved
    for _ in range(3):
        assert d.sched.schedule().is_empty  # waiting for transfer: never scheduled
    (r0, i0), (r1, i1), (r2, i2) = imps
    d.page.update({b: ("x", ()) for b in i0.dst_blocks[0]})
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
        assert not any(in_use(side.cache).values())
        assert side.cache.pages.num_checkpoint_pages == len(checkpoint_pages(side.cache))
        assert all(not n.ckpt_refs for n in side.cache.tree.nodes.values())  # every pin and reservation ended


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
    held = in_use(d.cache)
    assert held[0] == held[1] == len(imp.dst_blocks[0]) and held[2] == held[3] == 1  # its pages, its running slot
    assert d.cache.quarantined and "r" not in d.cache.req_blocks and "r" not in d.cache.running_slot
    reserved = set(imp.checkpoint.pages) if imp.checkpoint is not None else set()
    assert all(d.cache.pages.ref[b] == 1 for b in reserved)  # a reserved checkpoint's pages stay taken too
    d.sched.add_request(Request("r", prompt, SamplingParams(max_tokens=2)))  # the same id computes afresh
    while d.sched.requests:
        out = d.sched.schedule()
        for s in out.seqs:
            for gid, blocks in s.group_block_ids:
                assert not set(blocks) & set(imp.dst_blocks[gid]), "a quarantined block was handed out"
                assert not set(blocks) & reserved, "a quarantined checkpoint page was handed out"
            for gid, slot in s.group_state_slots:
                assert slot not in imp.dst_state_slots[gid]
        for _, pages in (*out.state_saves, *out.state_restores):
            assert not set(pages) & (reserved | set(imp.dst_blocks[0]))
        sampled = {s.request_id: (1, 0.0) for s in out.seqs if s.sample}
        for r in d.sched.update_from_output(out, sampled):
            if r.output_token_ids and len(r.output_token_ids) >= 2:
                d.core.finish(r, "length")
        d.cache.check_integrity()
    release_export(p.core, req, exp)
    p.cache.check_integrity()


def test_transfer_params_carry_every_group() -> None:
    """TransferParams round trip: per attention group blocks, per recurrent group running state slot (`states`),
    and the checkpoint as its pages (read like blocks)."""
    from hybridpd.decode.consumer import source_of
    from hybridpd.engine.transfer import Checkpoint
    from hybridpd.prefill.service import transfer_params
    from hybridpd.proto import hybridpd_pb2 as pb

    exp = Export("r", 11, {0: (3, 4, 5), 1: (3, 4, 5)}, {2: 6, 3: 6}, Checkpoint(8, (9, 12, 10)),
                 {0: (3, 4, 5, 9, 12, 10), 1: (3, 4, 5, 9, 12, 10), 2: (6,), 3: (6,)})
    tp = pb.TransferParams.FromString(transfer_params(exp).SerializeToString())
    assert tp.checkpoint_num_tokens == 8 and tp.num_computed_tokens == 11 and list(tp.checkpoint_pages) == [9, 12, 10]
    src = source_of(tp)
    assert src == ImportSource(11, {0: [3, 4, 5], 1: [3, 4, 5]}, {2: 6, 3: 6}, Checkpoint(8, (9, 12, 10)))


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
    assert not d.sched.requests and not any(in_use(d.cache).values())
    d.cache.check_integrity()
    release_export(p.core, req, exp)
