"""Capacity planner: exact per-group figures for NemotronH- and Qwen3.5-like layer sets, natural page sizes that do
not divide each other, clear errors for budgets that are too small, and a model-free scheduler run that fills
exactly token_capacity without preemption (one block more preempts).

    token_capacity = ((budget - state_slots * bytes_per_state) // bytes_per_block - 1) * block_size
    state_slots    = 1 (null) + max_num_seqs + checkpoint slots

Why exact: padding every layer's page to the largest (the Mamba/GDN state) page and charging it for all
layers under-reports attention capacity by two orders of magnitude and crashes when pages do not divide.
"""

from __future__ import annotations

import pytest
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
    return ((budget - slots * per_state) // per_block - 1) * block_size


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
    assert plan.state_slots == 49 and plan.state_bytes == 49 * 102_137_856
    assert plan.attention_blocks == 13_676
    assert plan.token_capacity == 218_800 == exact_capacity(groups, 8 * GiB, 49, 16)
    assert plan.attention_bytes + plan.state_bytes <= 8 * GiB < plan.attention_bytes + plan.state_bytes + 262_144
    assert plan.max_concurrency == 218_800 // 32768 == 6
    naive = naive_uniform_capacity(NEMO, 8 * GiB, 16)
    assert naive == 1_136
    assert plan.token_capacity // naive == 192  # not a 7x error: two orders of magnitude


def test_qwen35_like_capacity_is_exact() -> None:
    groups = group_layers(QWEN)
    assert [(g.kind, len(g.layer_ids)) for g in groups] == [("attention", 8), ("gated_deltanet", 24)]
    plan = plan_capacity(groups, 8 * GiB, max_num_seqs=16, num_checkpoint_slots=32, max_model_len=8192,
                         checkpoint_interval=256)
    assert plan.bytes_per_block == 524_288 and plan.bytes_per_state == 51_511_296
    assert plan.attention_blocks == 11_569
    assert plan.token_capacity == 185_088 == exact_capacity(groups, 8 * GiB, 49, 16)
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
    assert plan.state_slots == 13
    assert plan.token_capacity == exact_capacity(groups, budget, 13, 16)
    leftover = budget - plan.state_bytes - plan.attention_bytes
    assert 0 <= leftover < plan.bytes_per_block
    assert plan.layout().attention_blocks == plan.attention_blocks and plan.layout().state_slots == 13
    info = plan.as_dict()
    for key in ("kv_cache_memory_bytes", "block_size", "attention_blocks", "token_capacity", "bytes_per_token",
                "state_slots_running", "state_slots_checkpoint", "bytes_per_state", "max_concurrency"):
        assert key in info
    assert info["state_slots_running"] == 8 and info["state_slots_checkpoint"] == 4


def test_budget_edges_are_exact() -> None:
    groups = group_layers(QWEN)
    state = 13 * 51_511_296
    assert plan_capacity(groups, state + 2 * 524_288, 8, 4, 4096, 256).token_capacity == 16
    assert plan_capacity(groups, state + 3 * 524_288 - 1, 8, 4, 4096, 256).token_capacity == 16
    assert plan_capacity(groups, state + 3 * 524_288, 8, 4, 4096, 256).token_capacity == 32
    with pytest.raises(CapacityError) as err:
        plan_capacity(groups, state + 2 * 524_288 - 1, 8, 4, 4096, 256)
    msg = str(err.value)
    assert f"KV cache budget of {state + 2 * 524_288 - 1} bytes is too small" in msg
    assert f"13 state slots take {state} bytes" in msg and "2 blocks of 524288 bytes" in msg
    assert "max_num_seqs" in msg


def test_budget_smaller_than_the_state_slots_raises() -> None:
    with pytest.raises(CapacityError, match="too small: 49 state slots take 2524053504 bytes"):
        plan_capacity(group_layers(QWEN), 1 * GiB, 16, 32, 8192, 256)
    gdn_only = [CacheGroup(0, QWEN_GDN, tuple(range(24)))]
    with pytest.raises(CapacityError, match="cannot hold 49 state slots"):
        plan_capacity(gdn_only, 1 * GiB, 16, 32, 8192, 256)


def test_single_kind_models() -> None:
    attn_only = [CacheGroup(0, QWEN_ATTN, tuple(range(8)))]
    plan = plan_capacity(attn_only, 1 * GiB, 16, 32, 8192, 256)
    assert plan.state_slots == 0 and plan.state_bytes == 0 and plan.state_slots_checkpoint == 0
    assert plan.token_capacity == (GiB // 524_288 - 1) * 16 == 32_752
    gdn_only = [CacheGroup(0, QWEN_GDN, tuple(range(24)))]
    plan = plan_capacity(gdn_only, 4 * GiB, 16, 32, 8192, 256)
    assert plan.attention_blocks == 0 and plan.token_capacity == 0 and plan.state_slots == 49
    assert plan.max_concurrency == 16


# -- a scheduler run at exactly token_capacity ---------------------------------------------------------------------
TINY_ATTN = FullAttentionSpec(block_size=4, num_kv_heads=1, head_dim=2, dtype="float32")  # 64 B per block
TINY_MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")  # 80 B per layer


def tiny_plan() -> CapacityPlan:
    groups = group_layers({0: TINY_MAMBA, 1: TINY_ATTN, 2: TINY_MAMBA})
    budget = 9 * 160 + 17 * 64 + 63  # 9 slots, 17 blocks (16 usable), slack just under one block
    plan = plan_capacity(groups, budget, max_num_seqs=4, num_checkpoint_slots=4, max_model_len=16,
                         checkpoint_interval=8)
    assert plan.state_slots == 9 and plan.attention_blocks == 17 and plan.token_capacity == 64
    return plan


def run_to_completion(shapes: list[tuple[int, int]]) -> tuple[Scheduler, int]:
    """Requests of (prompt length, max_tokens), unique prompts (no sharing), all admitted in the first step."""
    plan = tiny_plan()
    groups = group_layers({0: TINY_MAMBA, 1: TINY_ATTN, 2: TINY_MAMBA})
    cache = HybridCacheManager(groups, plan.layout())
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache)
    for i, (n, mt) in enumerate(shapes):
        s.add_request(Request(f"r{i}", [100 * (i + 1) + j for j in range(n)], SamplingParams(max_tokens=mt)))
    peak, steps = 0, 0
    while s.num_unfinished:
        out = s.schedule()
        advanced = s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample})
        assert cache.attention is not None
        peak = max(peak, cache.attention.pool.stats()["in_use"])
        for req in advanced:
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                s.finish(req, "length")
        cache.check_integrity()
        steps += 1
        assert steps < 100
    return s, peak


def test_exactly_token_capacity_runs_without_preemption() -> None:
    # each request computes 10 + 7 - 1 = 16 tokens = 4 blocks; 4 requests = 64 tokens = token_capacity
    s, peak = run_to_completion([(10, 7)] * 4)
    assert peak == 16
    assert s.num_preemptions == 0


def test_one_block_more_preempts() -> None:
    # the last request computes 14 + 7 - 1 = 20 tokens = 5 blocks while the others still hold 4 each
    s, peak = run_to_completion([(10, 7)] * 3 + [(14, 7)])
    assert s.num_preemptions == 1
    assert peak == 13  # 3 x 3 blocks + 4: at 3 x 4 + 5 = 17 > 16 the latest request is preempted
