"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`): the engine against transformers on the same random weights (fp32 greedy
tokens identical, logprobs within 1e-4, chunked prefill mixed with decodes, a prefix hit), the grouped-GEMM routed
path against the reference loop, fused 3-D expert tensors loaded like per-expert ones, and TP 2 == TP 1."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.models.checkpoint import write_random_checkpoint
from hybridpd.engine.models.fast_path import moe_routed_masked
from hybridpd.engine.models.sparse_moe import SparseMoeArgs, SparseMoeBlock, split_fused_experts

from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYERS = ["linear_attention", "full_attention"]
NEW = 6
SETTINGS = {"max_num_batched_tokens": 32, "kv_cache_memory_bytes": 16 << 20, "max_model_len": 256}
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):  # type: ignore[no-untyped-def]
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qmoe")), "qwen3_5_moe", seed=1, layer_types=LAYERS)


def _generate(path: str, tp: int = 1) -> list:  # type: ignore[type-arg]
    prompts = random_prompts([4, 41, 70], 500, seed=6)
    llm = LLM(model=path, tensor_parallel_size=tp, **SETTINGS)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        outs += llm.generate(prompt_token_ids=[prompts[2] + [9, 8, 7]], sampling_params=GREEDY)
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()
    return [(o.prompt_token_ids, o.token_ids, o.logprobs, o.num_cached_tokens) for o in outs]


def test_matches_transformers(moe_model):  # type: ignore[no-untyped-def]
    outs = _generate(moe_model)
    assert outs[-1][3] > 0, "the prefix round found no cached prefix"
    for prompt, toks, lps, _ in outs:
        want, want_lps = hf_greedy(moe_model, prompt, NEW)
        assert toks == want, f"{len(prompt)}-token prompt: greedy tokens differ"
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4


def test_tp2_matches_tp1(moe_model):  # type: ignore[no-untyped-def]
    one, two = _generate(moe_model), _generate(moe_model, tp=2)
    for (_, t1, l1, _), (_, t2, l2, _) in zip(one, two, strict=True):
        assert t2 == t1
        assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) < 1e-4


def test_grouped_routing_equals_the_reference_loop() -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(24, SparseMoeArgs(num_experts=5, top_k=2, intermediate_size=16,
                                             shared_intermediate_size=8), "silu")
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(11, 24)
    weights, idx = block.route(x)
    want = block._routed_reference(x, weights, idx)
    block.fuse()
    assert torch.allclose(block.routed_grouped(x, weights, idx), want, atol=1e-5)
    assert torch.allclose(moe_routed_masked(block, x, weights, idx), want, atol=1e-5)


def test_fused_expert_tensors_split_into_per_expert_weights() -> None:
    gate_up, down = torch.randn(3, 8, 5), torch.randn(3, 5, 4)
    parts = dict(split_fused_experts("model.layers.0.mlp.experts.gate_up_proj", gate_up) or [])
    assert torch.equal(parts["model.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :4])
    assert torch.equal(parts["model.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, 4:])
    downs = dict(split_fused_experts("model.layers.0.mlp.experts.down_proj", down) or [])
    assert torch.equal(downs["model.layers.0.mlp.experts.1.down_proj.weight"], down[1]) and len(downs) == 3
    assert split_fused_experts("model.layers.0.mlp.gate.weight", down) is None
