"""Qwen3.5-MoE on a GPU: fp32 exact against transformers (the fast path's masked routing, CUDA graphs), bf16 as
precise as transformers' own bf16 (grouped GEMMs + the fused combine), and the grouped routed path equal to the
reference loop on CUDA in bf16."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.models.checkpoint import write_random_checkpoint
from hybridpd.engine.models.sparse_moe import SparseMoeArgs, SparseMoeBlock

from tests.oracle import hf_greedy, hf_model, random_prompts, score_under

pytestmark = pytest.mark.gpu
LENGTHS = [1, 9, 40, 130]
# dims multiples of 16 (grouped GEMM strides), 8 experts top 2, GDN + gated attention
MODEL = {"layer_types": ["linear_attention", "full_attention", "linear_attention"], "num_experts": 8,
         "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96}


@pytest.fixture(scope="module")
def path(tmp_path_factory):  # type: ignore[no-untyped-def]
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qmoe")), "qwen3_5_moe", seed=1, **MODEL)


def _generate(path: str, dtype: str, new: int) -> tuple[list[list[int]], list]:  # type: ignore[type-arg]
    """Greedy outputs of the fast path with CUDA graphs (checked to have replayed)."""
    prompts = random_prompts(LENGTHS, vocab=256, seed=1)
    llm = LLM(model=path, device="cuda", dtype=dtype, max_num_batched_tokens=48, kv_cache_memory_bytes=256 << 20,
              max_model_len=512)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=new, temperature=0,
                                                                                  ignore_eos=True))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
    return prompts, outs


def test_grouped_routing_equals_reference_on_cuda() -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(128, SparseMoeArgs(8, 2, 64, 96), "silu").cuda().bfloat16()
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(37, 128, device="cuda", dtype=torch.bfloat16)
    weights, idx = block.route(x)
    want = block._routed_reference(x, weights, idx)
    block.fuse()
    got = block.routed_grouped(x, weights, idx).float()
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()


def test_cuda_fp32_matches_transformers(path):  # type: ignore[no-untyped-def]
    prompts, outs = _generate(path, "float32", 16)
    for p, o in zip(prompts, outs, strict=True):
        toks, lps = hf_greedy(path, p, 16, "float32", "cuda")
        assert o.token_ids == toks
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps, strict=True)) < 1e-4


def test_cuda_bf16_as_precise_as_transformers_bf16(path):  # type: ignore[no-untyped-def]
    prompts, outs = _generate(path, "bfloat16", 12)
    truth = hf_model(path, "float32", "cuda")
    ours = score_under(truth, prompts, [(o.token_ids, o.logprobs) for o in outs], "cuda")
    theirs = score_under(truth, prompts, [hf_greedy(path, p, 12, "bfloat16", "cuda") for p in prompts], "cuda")
    assert ours["mean_lp_err"] <= 1.5 * theirs["mean_lp_err"] + 1e-3, (ours, theirs)
    assert ours["max_lp_err"] <= 2 * theirs["max_lp_err"] + 1e-2, (ours, theirs)
