"""Capacity planner: exact per-group figures for NemotronH- and Qwen3.5-like layer sets, natural page sizes that do
not divide each other, clear errors for budgets that are too small, and a model-free scheduler run that fills
exactly token_capacity without preemption (one block more preempts).

    k              = ceil(bytes_per_state / bytes_per_block)      (a state slot takes k pages' worth)
    state_slots    = 1 (null) + max_num_seqs + STAGING_SLOTS      (no checkpoint slot is reserved)
    token_capacity = ((budget - state_slots * k * bytes_per_block) // bytes_per_block - 1) * block_size

Why exact: padding every layer's page to the largest (the Mamba/GDN state) page and charging it for all
layers under-reports attention capacity by two orders of magnitude and crashes when pages do not divide.
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.planner import CapacityError, CapacityPlan, plan_capacity
from hybridpd.engine.cache.specs import CacheGroup, CacheSpec, FullAttentionSpec, RecurrentStateSpec, group_layers
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler

GiB = 2**30

# NemotronH-8B-like: 4 attention layers (8 KV heads x 128, bf16) + 24 Mamba-2 layers
# (128 heads x 64 head dim, state 128, 8 groups, conv kernel 4: conv_dim = 128*64 + 2*8*128 = 10240).
NEMO_ATTN = FullAttentionSpec(block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NEMO_MAMBA = RecurrentStateSpec("mamba2", (10240, 3), "bfloat16", (128, 64, 128), "float32")
NEMO_ATTN_LAYERS = (5, 12, 19, 26)
NEMO = {i: (NEMO_ATTN if i in NEMO_ATTN_LAYERS else NEMO_MAMBA) for i in range(28)}

# Qwen3.5-like: 8 gated full-attention layers (4 KV heads x 256, bf16) + 24 Gated-DeltaNet layers
# (16 key heads, 32 value heads, 128 dims, conv kernel 4: conv_dim = 2*16*128 + 32*128 = 8192).
QWEN_ATTN = FullAttentionSpec(block_size=16, num_kv_heads=4, head_dim=256, dtype="bfloat16")
QWEN_GDN = RecurrentStateSpec("gated_deltanet", (8192, 3), "bfloat16", (32, 128, 128), "float32")
QWEN = {i: (QWEN_ATTN if i % 4 == 3 else QWEN_GDN) for i in range(32)}


def exact_capacity(groups: list[CacheGroup], budget: int, slots: int, block_size: int) -> int:
    per_block = sum(g.page_bytes_all_layers for g in groups if g.is_attention)
    per_state = sum(g.page_bytes_all_layers for g in groups if not g.is_attention)
    k = -(-per_state // per_block)
    return ((budget - slots * k * per_block) // per_block - 1) * block_size


def naive_uniform_capacity(layers: dict[int, CacheSpec], budget: int, block_size: int) -> int:
    """The naive figure: every layer's page padded to the largest page, a block charged for every layer."""
    max_page = max(s.page_bytes for s in layers.values())
    return (budget // (max_page * len(layers)) - 1) * block_size


def test_page_sizes_are_natural_and_do_not_divide() -> None:
    assert NEMO_ATTN.page_bytes == 65_536 and NEMO_MAMBA.page_bytes == 4_255_744
    assert QWEN_ATTN.page_bytes == 65_536 and QWEN_GDN.page_bytes == 2_146_304
    assert NEMO_MAMBA.page_bytes % NEMO_ATTN.page_bytes != 0
    assert QWEN_GDN.page_bytes % QWEN_ATTN.page_bytes != 0


def test_nemotron_like_capacity_is_exact() -> None:
    groups = group_layers(NEMO)
    assert [(g.kind, len(g.layer_ids)) for g in groups] == [("attention", 4), ("mamba2", 24)]
    assert groups[0].layer_ids == NEMO_ATTN_LAYERS
    plan = plan_capacity(groups, 8 * GiB, max_num_seqs=16, num_checkpoint_slots=32, max_model_len=32768,
                         checkpoint_interval=256)
    assert plan.bytes_per_block == 262_144 and plan.bytes_per_token == 16_384
    assert plan.bytes_per_state == 102_137_856
    k = plan.blocks_per_checkpoint
    assert k == 390 == -(-102_137_856 // 262_144)  # a state slot: 390 pages' worth (padded by 102_304 B)
    assert plan.state_slots == 1 + 16 + STAGING_SLOTS == 19 and plan.state_bytes == 19 * k * 262_144
    assert plan.attention_blocks == 25_358
    assert plan.token_capacity == 405_712 == exact_capacity(groups, 8 * GiB, 19, 16)
    assert plan.attention_bytes + plan.state_bytes <= 8 * GiB < plan.attention_bytes + plan.state_bytes + 262_144
    assert plan.max_concurrency == 405_712 // 32768 == 12
    assert plan.state_slots_checkpoint == 32  # the cap: the pages could hold (25_358 - 1) // 390 = 65
    naive = naive_uniform_capacity(NEMO, 8 * GiB, 16)
    assert naive == 1_136
    assert plan.token_capacity // naive == 357  # not a 7x error: two orders of magnitude


def test_qwen35_like_capacity_is_exact() -> None:
    groups = group_layers(QWEN)
    assert [(g.kind, len(g.layer_ids)) for g in groups] == [("attention", 8), ("gated_deltanet", 24)]
    plan = plan_capacity(groups, 8 * GiB, max_num_seqs=16, num_checkpoint_slots=32, max_model_len=8192,
                         checkpoint_interval=256)
    assert plan.bytes_per_block == 524_288 and plan.bytes_per_state == 51_511_296
    assert plan.blocks_per_checkpoint == 99 and plan.state_slots == 19
    assert plan.attention_blocks == 14_503
    assert plan.token_capacity == 232_032 == exact_capacity(groups, 8 * GiB, 19, 16)
    assert plan.max_concurrency == 16
    assert naive_uniform_capacity(QWEN, 8 * GiB, 16) == 1_984
    # the old concurrency estimate: largest per-layer cost x all layers, vs the sum of per-group costs
    blocks = 8192 // 16
    exact_per_req = blocks * plan.bytes_per_block + plan.bytes_per_state
    naive_per_req = max(blocks * QWEN_ATTN.page_bytes, QWEN_GDN.page_bytes) * len(QWEN)
    assert exact_per_req == 319_946_752 and naive_per_req == 1_073_741_824


@pytest.mark.parametrize("layers", [NEMO, QWEN], ids=["nemotron", "qwen3.5"])
@pytest.mark.parametrize("budget", [3 * GiB, 8 * GiB + 12345, 40 * GiB + 7])
def test_capacity_formula_holds_for_any_budget(layers: dict[int, CacheSpec], budget: int) -> None:
    groups = group_layers(layers)
    plan = plan_capacity(groups, budget, 8, 4, 4096, 256)
    assert plan.state_slots == 1 + 8 + STAGING_SLOTS == 11
    assert plan.token_capacity == exact_capacity(groups, budget, 11, 16)
    leftover = budget - plan.state_bytes - plan.attention_bytes
    assert 0 <= leftover < plan.bytes_per_block
    assert plan.physical_bytes == plan.state_bytes + plan.attention_bytes == plan.arena.total_bytes  # type: ignore[union-attr]
    layout = plan.layout()
    assert (layout.num_pages, layout.num_slots) == (plan.attention_blocks, 11)
    assert layout.pages_per_state == plan.blocks_per_checkpoint and layout.max_checkpoints == 4
    info = plan.as_dict()
    for key in ("kv_cache_memory_bytes", "block_size", "attention_blocks", "token_capacity", "bytes_per_token",
                "state_slots_running", "state_slots_checkpoint", "bytes_per_state", "max_concurrency"):
        assert key in info
    assert info["state_slots_running"] == 8 and info["state_slots_checkpoint"] == 4


def test_budget_edges_are_exact() -> None:
    groups = group_layers(QWEN)
    state = 11 * 99 * 524_288  # 11 state slots of k = 99 pages
    assert plan_capacity(groups, state + 2 * 524_288, 8, 4, 4096, 256).token_capacity == 16
    assert plan_capacity(groups, state + 3 * 524_288 - 1, 8, 4, 4096, 256).token_capacity == 16
    assert plan_capacity(groups, state + 3 * 524_288, 8, 4, 4096, 256).token_capacity == 32
    with pytest.raises(CapacityError) as err:
        plan_capacity(groups, state + 2 * 524_288 - 1, 8, 4, 4096, 256)
    msg = str(err.value)
    assert f"KV cache budget of {state + 2 * 524_288 - 1} bytes is too small" in msg
    assert f"11 state slots take {state} bytes" in msg and "2 blocks of 524288 bytes" in msg
    assert "max_num_seqs" in msg


def test_budget_smaller_than_the_state_slots_raises() -> None:
    # 19 slots x 99 pages x 524_288 B = 986_185_728 B: more than half a GiB
    with pytest.raises(CapacityError, match="too small: 19 state slots take 986185728 bytes"):
        plan_capacity(group_layers(QWEN), GiB // 2, 16, 32, 8192, 256)
    gdn_only = [CacheGroup(0, QWEN_GDN, tuple(range(24)))]
    with pytest.raises(CapacityError, match="too small: 19 state slots take .* no checkpoint page fits"):
        plan_capacity(gdn_only, GiB // 2, 16, 32, 8192, 256)


def test_single_kind_models() -> None:
    attn_only = [CacheGroup(0, QWEN_ATTN, tuple(range(8)))]
    plan = plan_capacity(attn_only, 1 * GiB, 16, 32, 8192, 256)
    assert plan.state_slots == 0 and plan.state_bytes == 0 and plan.state_slots_checkpoint == 0
    assert plan.token_capacity == (GiB // 524_288 - 1) * 16 == 32_752
    gdn_only = [CacheGroup(0, QWEN_GDN, tuple(range(24)))]
    plan = plan_capacity(gdn_only, 4 * GiB, 16, 32, 8192, 256)
    assert plan.attention_blocks == 0 and plan.token_capacity == 0 and plan.state_slots == 19
    assert plan.max_concurrency == 16 and plan.blocks_per_checkpoint == 1  # a page is one state
    pages = (4 * GiB - 19 * 51_511_296) // 51_511_296
    assert plan.arena.num_pages == pages == 64 and plan.state_slots_checkpoint == 32  # type: ignore[union-attr]
    uncapped = plan_capacity(gdn_only, 4 * GiB, 16, None, 8192, 256)
    assert uncapped.state_slots_checkpoint == pages - 1 and uncapped.layout().max_checkpoints is None
    assert plan.block_size == 256  # no attention: checkpoints hash on the checkpoint interval


def test_a_policy_does_not_change_the_arena() -> None:
    """With or without a cache policy the planner builds the same arena; the policy only rides along."""
    groups = group_layers(NEMO)
    plain = plan_capacity(groups, 8 * GiB, 16, None, 32768, 256)
    with_policy = plan_capacity(groups, 8 * GiB, 16, None, 32768, 256, policy=CachePolicy(interval=256))
    assert plain == with_policy and plain.arena == with_policy.arena and plain.arena is not None
    assert plain.layout().policy is None and with_policy.layout().policy == CachePolicy(interval=256)
    assert plain.state_slots_checkpoint == (plain.attention_blocks - 1) // plain.blocks_per_checkpoint == 65


# -- a scheduler run at exactly token_capacity ---------------------------------------------------------------------
TINY_ATTN = FullAttentionSpec(block_size=4, num_kv_heads=1, head_dim=2, dtype="float32")  # 64 B per block
TINY_MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")  # 80 B per layer


def tiny_plan() -> CapacityPlan:
    groups = group_layers({0: TINY_MAMBA, 1: TINY_ATTN, 2: TINY_MAMBA})
    # 7 slots (null, 4 running, 2 staging) of k = 3 pages (160 B of state in 192), 17 pages (16 usable),
    # slack just under one page
    budget = 7 * 3 * 64 + 17 * 64 + 63
    plan = plan_capacity(groups, budget, max_num_seqs=4, num_checkpoint_slots=4, max_model_len=16,
                         checkpoint_interval=8)
    assert plan.state_slots == 7 and plan.blocks_per_checkpoint == 3
    assert plan.attention_blocks == 17 and plan.token_capacity == 64
    return plan


def run_to_completion(shapes: list[tuple[int, int]], caching: bool) -> tuple[Scheduler, int, int]:
    """Requests of (prompt length, max_tokens), unique prompts (no sharing). Returns the scheduler, the most pages
    requests held at once, and how many requests the first step admitted."""
    plan = tiny_plan()
    groups = group_layers({0: TINY_MAMBA, 1: TINY_ATTN, 2: TINY_MAMBA})
    cache = HybridCacheManager(groups, plan.layout(), enable_prefix_caching=caching)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache)
    for i, (n, mt) in enumerate(shapes):
        s.add_request(Request(f"r{i}", [100 * (i + 1) + j for j in range(n)], SamplingParams(max_tokens=mt)))
    peak, steps, first = 0, 0, -1
    while s.num_unfinished:
        out = s.schedule()
        if first < 0:
            first = len(out.seqs)
        advanced = s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample})
        (attn,) = [p for p in cache.pool_stats() if p["kind"] == "attention"]
        assert attn["in_use"] == cache.num_in_use
        peak = max(peak, cache.num_in_use)
        for req in advanced:
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                s.finish(req, "length")
        cache.check_integrity()
        steps += 1
        assert steps < 100
    return s, peak, first


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "caching"])
def test_exactly_token_capacity_runs_without_preemption(caching: bool) -> None:
    # each request computes 10 + 7 - 1 = 16 tokens = 4 blocks; 4 requests = 64 tokens = token_capacity; with
    # caching, the checkpoints they save take pages too, and are evicted for the requests' blocks
    s, peak, _ = run_to_completion([(10, 7)] * 4, caching)
    assert peak == 16
    assert s.num_preemptions == 0


def test_one_block_more_preempts() -> None:
    # the last request computes 14 + 7 - 1 = 20 tokens = 5 blocks while the others still hold 4 each (no caching:
    # the pages hold requests' blocks only)
    s, peak, first = run_to_completion([(10, 7)] * 3 + [(14, 7)], caching=False)
    assert first == 4  # all admitted in the first step
    assert s.num_preemptions == 1
    assert peak == 13  # 3 x 3 blocks + 4: at 3 x 4 + 5 = 17 > 16 the latest request is preempted
