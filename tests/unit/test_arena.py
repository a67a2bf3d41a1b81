"""One arena backs every cache: state slots first, then pages that attention blocks and cached checkpoints share.

    | slot 0 (null) | slot 1 .. max_num_seqs (running) | STAGING_SLOTS staging | page 0 (null) | page 1 | ... |
    slot s = rows s*k .. s*k+k-1;  page j = row num_slots*k + j;  a cached checkpoint = any k pages

1. planner: what is allocated is the budget (less than a page short); with no reuse the attention capacity is
   >= 0.99 of the one-state-per-running-request optimum at the issue's shapes; the layout puts every part where the
   module docstring says;
2. control plane, exact ids: a checkpoint takes any k free pages (no range, no contiguity); with no free page it
   evicts cached blocks (dead-end leaves first) and blocks evict it in turn; a checkpoint inside a chunk is written
   to a staging slot, never to one a new request may still need for running;
3. random traces with a shadow of the arena's rows (kernels write blocks and slots, saves copy slot rows to pages,
   restores pages to slot rows): every hit reads what it should, a page is a block or a checkpoint's piece, never
   both, no leaks, integrity after every step;
4. tensors: the views share one storage, a page and a slot share no byte, a save and a restore are row copies; the
   transfer layout registers the arena's slots and pages (two spans of the one allocation) and gives the right page
   addresses.
"""

from __future__ import annotations

import random

import pytest
import torch
from hybridpd.engine.arena import allocate_caches
from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS, ArenaLayout, plan_arena
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.planner import CapacityPlan, plan_capacity
from hybridpd.engine.cache.specs import NULL_BLOCK_ID, PAD_SLOT_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerOutput
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.pool_views import checkpoint_pages, free_pages, page_bytes

GiB = 2**30
BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")  # 64 B per layer
GDN = RecurrentStateSpec("gated_deltanet", (4, 3), "float32", (2, 2, 4), "float32")  # 48 + 64 B per layer
GROUPS = [CacheGroup(0, ATTN, (0, 3)), CacheGroup(1, GDN, (1, 2, 4))]
B = page_bytes(GROUPS[:1])  # 128
K = -(-page_bytes(GROUPS[1:]) // B)  # 336 B of state: 3 pages


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def lead(pairs, empty=()):  # type: ignore[no-untyped-def]
    """The first group's entry of a per-group tuple ((group id, value), ...) (`empty` when there is none)."""
    return pairs[0][1] if pairs else empty


def arena_budget(max_num_seqs: int, pages: int) -> int:
    return (1 + max_num_seqs + STAGING_SLOTS) * K * B + pages * B


def make(max_num_seqs: int, pages: int, policy: CachePolicy | None = None) -> tuple[CapacityPlan, HybridCacheManager]:
    plan = plan_capacity(GROUPS, arena_budget(max_num_seqs, pages), max_num_seqs, None, 64, 0,
                         policy=policy or CachePolicy())
    assert plan.attention_blocks == pages
    return plan, HybridCacheManager(GROUPS, plan.layout())


def req(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def step_done(cache: HybridCacheManager, r: Request, n: int) -> None:
    r.num_computed_tokens = n
    cache.on_step_done([r])


def test_sizes() -> None:
    assert (B, K) == (128, 3)


# -- 1. planner ----------------------------------------------------------------------------------------------------
NEMO = [CacheGroup(0, FullAttentionSpec(16, 8, 128, "bfloat16"), (3, 7, 11, 15)),
        CacheGroup(1, RecurrentStateSpec("mamba2", (10240, 3), "bfloat16", (64, 64, 128), "float32"),
                   tuple(i for i in range(16) if i % 4 != 3))]


@pytest.mark.parametrize(("budget_gib", "share"), [(8, 0.988), (20, 0.995)])
def test_physical_bytes_are_the_budget_and_capacity_is_optimal(budget_gib: int, share: float) -> None:
    budget, seqs = budget_gib * GiB, 64
    plan = plan_capacity(NEMO, budget, seqs, None, 8192, 0, policy=CachePolicy())
    block, state = plan.bytes_per_block, plan.bytes_per_state
    k = plan.blocks_per_checkpoint
    assert plan.physical_bytes <= budget < plan.physical_bytes + block
    optimum = (budget - seqs * state) // block  # one state per running request, everything else attention
    # what the arena reserves beyond that: the null page, the null and staging slots, a state padded to k pages
    assert plan.attention_blocks == (budget - (1 + seqs + STAGING_SLOTS) * k * block) // block
    assert (plan.attention_blocks - 1) / optimum >= share
    assert k == cdiv(state, block) and plan.state_slots_checkpoint == (plan.attention_blocks - 1) // k
    assert plan.arena is not None and plan.arena.total_bytes == plan.physical_bytes
    layout = plan.layout()
    assert (layout.num_pages, layout.num_slots, layout.pages_per_state) == (plan.attention_blocks,
                                                                              1 + seqs + STAGING_SLOTS, k)


def test_the_layout_puts_slots_first_then_pages() -> None:
    seqs, pages = 2, 10
    a = plan_arena(GROUPS, arena_budget(seqs, pages) + B - 1, seqs)
    assert isinstance(a, ArenaLayout)
    assert (a.page_bytes, a.pages_per_state, a.num_slots, a.num_pages) == (B, K, 1 + seqs + STAGING_SLOTS, pages)
    assert a.slot_stride == K * B and a.pages_offset == a.num_slots * K * B and a.first_page_row == a.num_slots * K
    assert a.total_bytes == a.pages_offset + pages * B == arena_budget(seqs, pages)
    assert a.pages_are_blocks and list(a.slot_rows(2)) == [2 * K, 2 * K + 1, 2 * K + 2]
    kv, conv, ssm = a.parts
    assert (kv.name, kv.offset, kv.page_stride, kv.num_pages) == ("kv", a.pages_offset, B, pages)
    assert kv.page_bytes == B  # one block of both attention layers: the whole page
    assert (conv.name, conv.offset, conv.page_stride, conv.num_pages) == ("conv", 0, K * B, a.num_slots)
    assert (ssm.name, ssm.offset, ssm.page_stride) == ("ssm", conv.page_bytes, K * B)
    assert conv.page_bytes + ssm.page_bytes == a.state_bytes <= K * B  # a state fits its slot
    # a model without attention: a page is one state, pages hold checkpoints only
    r = plan_arena(GROUPS[1:], 10 * a.state_bytes, 2)
    assert (r.page_bytes, r.pages_per_state, r.num_slots, r.num_pages) == (a.state_bytes, 1, 5, 5)
    assert not r.pages_are_blocks


# -- 2. exact ids --------------------------------------------------------------------------------------------------
def test_a_checkpoint_takes_any_k_free_pages() -> None:
    plan, cache = make(2, 12)
    a, b, c = req("a", list(range(8))), req("b", list(range(100, 104))), req("c", list(range(200, 208)))
    assert cache.allocate(a, 8) and cache.allocate(b, 4) and cache.allocate(c, 8)
    assert (cache.req_blocks["a"], cache.req_blocks["b"], cache.req_blocks["c"]) == ([1, 2], [3], [4, 5])
    cache.free(a)  # never computed: unnamed, so its pages are free again (given back tail first)
    cache.free(c)
    assert free_pages(cache) == {1, 2, 4, 5, *range(6, 12)}
    x = req("x", list(range(300, 310)))  # its prompt-end checkpoint is at 8
    assert cache.allocate(x, 10)
    assert cache.req_blocks["x"] == [4, 5, 1] and cache.running_slot["x"] == 1  # the last given back first
    assert lead(cache.checkpoint_plan(x, 0, 8)[0]) == ()  # the boundary ends the chunk: no staging slot
    (save,) = cache.take_saves()
    assert save == (1, (2, 6, 7))  # from the running slot to any 3 free pages
    step_done(cache, x, 8)
    assert checkpoint_pages(cache) == {2, 6, 7} and cache.pages.num_checkpoint_pages == K
    assert all(cache.pages.ref[p] == 1 for p in (2, 6, 7))
    cache.free(x)
    cache.free(b)
    cache.check_integrity()
    # a request sharing x's first 8 tokens restores the checkpoint from those pages into its running slot
    y = req("y", list(range(300, 308)) + [1, 2, 3])
    hit = cache.find_prefix_hit(y)
    assert hit.num_tokens == 8 and hit.checkpoint is not None and hit.checkpoint.ckpt == (2, 6, 7)
    assert hit.blocks == (4, 5)
    assert cache.allocate(y, 11, hit)
    assert cache.running_slot["y"] == 1 and cache.take_restores() == ((1, (2, 6, 7)),)
    assert hit.checkpoint.ckpt_refs == 1  # held until the restore ran
    step_done(cache, y, 11)
    assert hit.checkpoint.ckpt_refs == 0
    cache.check_integrity()


def test_a_checkpoint_evicts_dead_end_blocks_when_no_page_is_free() -> None:
    plan, cache = make(1, 16)  # 15 usable pages
    x = req("x", list(range(100, 160)))  # 15 blocks: every page
    assert cache.allocate(x, 60) and cache.req_blocks["x"] == list(range(1, 16))
    step_done(cache, x, 60)
    cache.free(x)  # all 15 cached, no checkpoint anywhere
    assert free_pages(cache) == set() and cache.tree.num_checkpoints == 0
    y = req("y", [1, 2, 3, 4, 5])  # 2 blocks: x's last two (dead-end leaves, the tail first) go
    assert cache.allocate(y, 5)
    assert sorted(cache.req_blocks["y"]) == [14, 15] and cache.tree.num_evictions == [2, 0]
    cache.checkpoint_plan(y, 0, 4)  # y's prompt end: K more pages, from x's chain tail again
    (save,) = cache.take_saves()
    assert sorted(save[1]) == [11, 12, 13] and cache.tree.num_evictions == [5, 0]
    probe = req("probe", list(range(100, 160)))
    assert cache.find_prefix_hit(probe, max_tokens=60, count=False).num_tokens == 0  # no checkpoint: no hit
    assert len(cache.find_transfer_hit(probe, 60).blocks) == 10  # the chain ends where the evicted tail began
    step_done(cache, y, 5)
    cache.check_integrity()
    # blocks evict the checkpoint in turn once it is the cheapest item and pages run out
    cache.free(y)
    z = req("z", list(range(500, 560)))
    assert cache.allocate(z, 60)
    assert cache.tree.num_checkpoints == 0 and {11, 12, 13} <= set(cache.req_blocks["z"])
    cache.check_integrity()


def test_no_reuse_run_keeps_the_optimum_capacity() -> None:
    """After a no-reuse run filled the cache with whatever it keeps, running requests can still take every page but
    the null one (cached blocks and checkpoints are evicted for them, k pages per checkpoint)."""
    seqs, pages = 2, 80
    plan, cache = make(seqs, pages)
    sched = Scheduler(SchedulerConfig(seqs, 64), cache)
    for i in range(12):
        sched.add_request(req(f"j{i}", [100 * i + t for t in range(30)], max_tokens=6))
    while sched.num_unfinished:
        out = sched.schedule()
        for r in sched.update_from_output(out, {s.request_id: (7, 0.0) for s in out.seqs if s.sample}):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                sched.finish(r, "length")
        cache.check_integrity()
    assert cache.tree.num_checkpoints > 0, "the run should have left checkpoints"
    assert cache.pages.num_checkpoint_pages == K * cache.tree.num_checkpoints
    big = req("big", [2])
    n = 0
    while cache.allocate(big, n + BS):
        n += BS
    assert len(cache.req_blocks["big"]) == pages - 1  # every page but the null one
    assert cache.tree.num_checkpoints == 0 and cache.pages.num_checkpoint_pages == 0 and not cache.tree.nodes
    cache.check_integrity()


def test_a_checkpoint_inside_a_chunk_is_written_to_a_staging_slot() -> None:
    seqs = 1
    plan, cache = make(seqs, 40, CachePolicy(interval=4))
    assert plan.state_slots == 1 + seqs + STAGING_SLOTS == 4
    a = req("a", list(range(21)))  # interval 4: checkpoints every 4 tokens, and the prompt end at 20
    assert cache.allocate(a, 20)
    assert cache.running_slot["a"] == 1
    inside = lead(cache.checkpoint_plan(a, 0, 20)[0])
    assert inside == ((4, 2), (8, 3))  # two staging slots: 12 and 16 are not saved this step
    saves = cache.take_saves()
    assert [s for s, _ in saves] == [2, 3, 1]  # the staging slots, then the running slot at the chunk's end (20)
    assert len({p for _, pages in saves for p in pages}) == 3 * K
    assert cache.slots.free == [] and cache.staging == [2, 3]
    step_done(cache, a, 20)
    assert sorted(cache.slots.free) == [2, 3] and cache.staging == []  # freed after the step
    assert cache.tree.num_checkpoints == 3
    cache.check_integrity()


def test_staging_never_takes_a_slot_a_new_request_needs_for_running() -> None:
    seqs = 2
    plan, cache = make(seqs, 40, CachePolicy(interval=4))
    a = req("a", list(range(21)))
    assert cache.allocate(a, 20)
    # 3 slots free (2, 3, 4), one of them kept for the second running request: 2 may stage
    assert lead(cache.checkpoint_plan(a, 0, 20)[0]) == ((4, 2), (8, 3))
    b = req("b", list(range(100, 109)))
    assert cache.allocate(b, 8) and cache.running_slot["b"] == 4
    step_done(cache, a, 20)
    cache.take_saves()
    assert lead(cache.checkpoint_plan(b, 0, 8)[0]) == ((4, 2),)  # both running: every free slot may stage
    cache.check_integrity()


# -- 3. random traces with a shadow of the arena's rows -------------------------------------------------------------
class Shadow:
    """What each row of the arena holds: a page's block (salt, the tokens up to its end), a row of a state (salt,
    tokens, which of its k rows)."""

    def __init__(self, arena: ArenaLayout) -> None:
        self.a = arena
        self.rows: dict[int, object] = {}

    def page_row(self, p: int) -> int:
        return self.a.first_page_row + p

    def write_state(self, slot: int, content: tuple[object, ...]) -> None:
        for j, r in enumerate(self.a.slot_rows(slot)):
            self.rows[r] = (*content, j)

    def read_state(self, slot: int) -> list[object]:
        return [self.rows.get(r) for r in self.a.slot_rows(slot)]

    def copy(self, copies: tuple[tuple[int, tuple[int, ...]], ...], save: bool) -> None:
        for slot, pages in copies:
            slot_rows, page_rows = list(self.a.slot_rows(slot)), [self.page_row(p) for p in pages]
            src, dst = (slot_rows, page_rows) if save else (page_rows, slot_rows)
            got = [self.rows.get(r) for r in src]
            for r, v in zip(dst, got, strict=True):
                self.rows[r] = v


class ArenaHarness:
    def __init__(self, seed: int, max_num_seqs: int, spare: int, interval: int, budget: int, n_reqs: int) -> None:
        rng = self.rng = random.Random(seed)
        prefixes = [[rng.randrange(50) for _ in range(rng.randrange(8, 25))] for _ in range(3)]
        self.specs = []
        for _ in range(n_reqs):  # (arrival step, prompt: a shared prefix's head and a tail, max_tokens, salt, abort)
            prompt = rng.choice(prefixes)[: rng.randrange(4, 25)] + [rng.randrange(50) for _ in
                                                                     range(rng.randrange(0, 6))]
            self.specs.append((rng.randrange(0, 2 * n_reqs), prompt, rng.randrange(1, 9),
                               rng.choice([None, None, None, "s"]), rng.random() < 0.1))
        need = max(cdiv(len(p) + mt, BS) for _, p, mt, _, _ in self.specs)
        plan = plan_capacity(GROUPS, arena_budget(max_num_seqs, 1 + need + spare), max_num_seqs, None, 64, 0,
                             policy=CachePolicy(interval=interval))
        assert plan.arena is not None
        self.cache = HybridCacheManager(GROUPS, plan.layout())
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget), self.cache)
        self.shadow = Shadow(plan.arena)
        self.reqs: dict[str, Request] = {}

    def run(self) -> None:
        pending = sorted(enumerate(self.specs), key=lambda kv: kv[1][0])
        step = 0
        while pending or self.sched.num_unfinished:
            while pending and pending[0][1][0] <= step:
                i, (_, prompt, mt, salt, _) = pending.pop(0)
                r = Request(f"r{i}", list(prompt), SamplingParams(max_tokens=mt), cache_salt=salt)
                self.reqs[r.request_id] = r
                self.sched.add_request(r)
            for i, (arrival, _, _, _, abort) in enumerate(self.specs):
                if abort and arrival + 2 == step and f"r{i}" in self.sched.requests:
                    self.sched.abort(f"r{i}")
            self.one_step()
            step += 1
            assert step < 500, "no progress"
        self.check_no_leak()

    def one_step(self) -> None:
        out = self.sched.schedule()
        self.simulate(out)
        sampled = {s.request_id: (len(self.sched.requests[s.request_id].all_token_ids) % 50, 0.0)
                   for s in out.seqs if s.sample}
        for r in self.sched.update_from_output(out, sampled):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                self.sched.finish(r, "length")
        self.cache.check_integrity()
        self.check_pages()

    def simulate(self, out: SchedulerOutput) -> None:
        sh = self.shadow
        sh.copy(out.state_restores, save=False)  # the running state check below reads what they restored
        for s in out.seqs:
            r = self.sched.requests[s.request_id]
            toks, salt = tuple(r.all_token_ids), r.cache_salt
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            blocks, slot = lead(s.group_block_ids), lead(s.group_state_slots, PAD_SLOT_ID)
            # (a chunk cut short at a checkpoint keeps the blocks allocated for all of it)
            assert slot not in (NULL_BLOCK_ID, PAD_SLOT_ID) and len(blocks) >= cdiv(end, BS)
            for i, p in enumerate(blocks[: cdiv(start, BS)]):  # attention reads the blocks before the chunk
                assert sh.rows.get(sh.page_row(p)) == ("kv", salt, toks[: min(start, (i + 1) * BS)]), (r, i, p)
            if start > 0:  # the recurrent layers read the running state
                assert sh.read_state(slot) == [("state", salt, toks[:start], j) for j in range(K)], s.request_id
            for i in range(start // BS, cdiv(end, BS)):
                sh.rows[sh.page_row(blocks[i])] = ("kv", salt, toks[: min(end, (i + 1) * BS)])
            for b, staging in lead(s.group_checkpoints):
                assert start < b < end and staging != slot
                sh.write_state(staging, ("state", salt, toks[:b]))
            sh.write_state(slot, ("state", salt, toks[:end]))
        sh.copy(out.state_saves, save=True)

    def check_pages(self) -> None:
        """Between steps: a page is a request's block, a cached block, a checkpoint's piece or free, one at a time;
        every cached checkpoint's pages hold the state after its tokens."""
        cache, sh = self.cache, self.shadow
        blocks = {n.page for n in cache.tree.nodes.values() if n.page}
        held = {p for bl in cache.req_blocks.values() for p in bl}
        ckpt = [p for n in cache.tree.nodes.values() for p in n.ckpt or ()]
        assert len(ckpt) == len(set(ckpt)) and not set(ckpt) & (blocks | held | free_pages(cache))
        assert not (blocks | held) & free_pages(cache) and NULL_BLOCK_ID not in blocks | held | set(ckpt)
        for node in cache.tree.nodes.values():
            if node.page:  # a cached block holds the KV of the tokens up to its end
                row = sh.rows.get(sh.page_row(node.page))
                assert row is not None and row[0] == "kv" and len(row[2]) == node.tokens, (node.tokens, row)  # type: ignore[index]
            if node.ckpt is not None:  # a cached checkpoint: the k rows of one state after its tokens
                got = [sh.rows.get(sh.page_row(p)) for p in node.ckpt]
                assert all(g is not None and g[0] == "state" and g[3] == j for j, g in enumerate(got)), got  # type: ignore[index]
                assert len({g[:3] for g in got}) == 1 and len(got[0][2]) == node.tokens, got  # type: ignore[index]
        slots = list(cache.running_slot.values())
        assert len(set(slots)) == len(slots) <= self.sched.config.max_num_seqs and not cache.staging

    def check_no_leak(self) -> None:
        cache = self.cache
        assert not self.sched.requests and cache.req_blocks == {} and cache.running_slot == {}
        assert cache.num_in_use == 0 and cache.slots.capacity == len(cache.slots.free)
        stats = cache.pool_stats()
        assert all(s["in_use"] == 0 for s in stats), stats


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), max_num_seqs=st.integers(1, 4), spare=st.integers(0, 3) | st.integers(0, 40),
       interval=st.sampled_from([0, 0, 4, 8, 12]), budget=st.integers(1, 24), n_reqs=st.integers(2, 12))
def test_random_traces_on_the_arena_keep_every_invariant(seed: int, max_num_seqs: int, spare: int, interval: int,
                                                        budget: int, n_reqs: int) -> None:
    ArenaHarness(seed, max_num_seqs, spare, interval, budget, n_reqs).run()


def test_a_shared_prefix_workload_reuses_pages_for_blocks_and_checkpoints() -> None:
    """A deterministic trace where pages that held KV blocks later hold checkpoints, and the reverse."""
    h = ArenaHarness(seed=12, max_num_seqs=2, spare=4, interval=0, budget=12, n_reqs=12)
    cache = h.cache
    roles: dict[int, set[str]] = {}
    step = h.one_step

    def spy() -> None:
        step()
        for node in cache.tree.nodes.values():
            if node.page:
                roles.setdefault(node.page, set()).add("block")
            for p in node.ckpt or ():
                roles.setdefault(p, set()).add("ckpt")

    h.one_step = spy  # type: ignore[method-assign]
    h.run()
    assert sum({"block", "ckpt"} <= r for r in roles.values()) > 0, roles
    assert sum(r.num_cached_tokens > 0 for r in h.reqs.values()) > 0  # and hits restored checkpoints


# -- 4. tensors and transfers ---------------------------------------------------------------------------------------
def test_views_share_one_arena_and_saves_and_restores_are_row_copies() -> None:
    seqs, pages = 2, 12
    plan, _ = make(seqs, pages)
    arena = plan.arena
    assert arena is not None
    rows, t = allocate_caches(GROUPS, plan, torch.device("cpu"))
    (kv,), (conv, ssm) = t[0], t[1]
    assert kv.shape[0] == pages and conv.shape[0] == ssm.shape[0] == plan.state_slots == 1 + seqs + STAGING_SLOTS
    assert rows.shape == (arena.first_page_row + pages, B // 8)
    ptr = rows.untyped_storage().data_ptr()
    assert {x.untyped_storage().data_ptr() for x in (kv, conv, ssm)} == {ptr}
    assert rows.untyped_storage().nbytes() == plan.physical_bytes
    assert all(x[0].is_contiguous() for x in (kv, conv, ssm))
    ssm[2] = 7.0
    conv[2] = 5.0  # a state slot: its k rows, no page
    nonzero = {int(i) for i in rows.abs().sum(1).nonzero()}
    assert nonzero <= set(arena.slot_rows(2)) and nonzero
    kv[5] = 1.0  # page 5: its row only
    assert {int(i) for i in rows.abs().sum(1).nonzero()} - nonzero == {arena.first_page_row + 5}
    # a save: slot 2's rows to the pages of a checkpoint, any 3 of them; a restore: back into slot 1
    ckpt = [9, 3, 11]
    page_rows = torch.tensor([arena.first_page_row + p for p in ckpt])
    rows.index_copy_(0, page_rows, rows.index_select(0, torch.tensor(list(arena.slot_rows(2)))))
    conv[2] = 0.0
    ssm[2] = 0.0
    assert kv[5].abs().sum() > 0 and all(kv[p].abs().sum() > 0 for p in ckpt)
    rows.index_copy_(0, torch.tensor(list(arena.slot_rows(1))), rows.index_select(0, page_rows))
    assert bool((ssm[1] == 7.0).all()) and bool((conv[1] == 5.0).all()) and ssm[2].abs().sum() == 0


def test_transfer_layout_registers_the_slots_and_the_pages_with_the_right_addresses() -> None:
    from hybridpd.kvtransfer.agent import registration_spans
    from hybridpd.kvtransfer.layout import CacheLayout, GroupTensors

    plan, _ = make(2, 15)
    _, t = allocate_caches(GROUPS, plan, torch.device("cpu"))
    layout = CacheLayout.from_tensors(
        [GroupTensors(0, "attention", [t[0][0]], (0, 3), stacked=True),
         GroupTensors(1, "gated_deltanet", [t[1]], (1, 2, 4), stacked=True)], model_id="m")
    spans = registration_spans(layout.regions)
    base = t[0][0].untyped_storage().data_ptr()
    arena = plan.arena
    assert arena is not None
    # two registrations inside the one allocation: the state slots (up to the last slot's state: its padding is
    # a gap) and the pages; nothing overlaps, so nothing merges them
    slots_end = (arena.num_slots - 1) * arena.slot_stride + arena.state_bytes
    assert spans == [(base, slots_end, 0, ""), (base + arena.pages_offset, arena.num_pages * B, 0, "")]
    assert base + plan.physical_bytes == spans[1][0] + spans[1][1]
    kv_region, conv_region, ssm_region = layout.regions
    assert kv_region.page_addr(5) == base + arena.pages_offset + 5 * B and kv_region.pages_contiguous
    assert conv_region.page_addr(3) == t[1][0][3].data_ptr() == base + 3 * arena.slot_stride
    assert ssm_region.page_addr(3) == t[1][1][3].data_ptr() and not ssm_region.pages_contiguous
