"""The batched fast path on CUDA (decode steps through CUDA graphs) against the reference path on the same GPU (same
weights, same engine settings): fp32 tokens identical and logprobs within 1e-4. bf16: both paths' greedy runs are
scored under transformers' fp32 forward (tests/oracle.score_under, teacher-forced); the fast path is as precise as
the reference path (mean logprob error at most 1.5x, max at most 2x) and every token where it departs from the
fp32 argmax is a near-tie (margin <= 0.1 nats, or no larger than the reference path's own largest flip).
Identical bf16 tokens between two correct implementations are luck on near-ties: on the H200 (2026-11-23,
benchmarks/diag_precision.py) both paths and transformers' own bf16 flip near-ties of 0.02-0.08 nats, and an
MoE's router flips experts in bf16 in every implementation. Chunked prefill (48-token
budget) with checkpoints every 32 tokens, so prefix states, checkpoint rounds and mixed prefill/decode steps run.
Also a model whose attention and recurrent layers are split into two cache groups each (tests/support/
split_groups.py): decode graphs with one set of static buffers per group view, against the unsplit reference."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.device import missing_fast_path_packages

from tests.oracle import hf_model, random_prompts, score_under
from tests.support.forward_path import forward_path

pytestmark = pytest.mark.gpu

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
PATTERNS = ["nemotron_attn_mid", "qwen_attn_last"]


def _generate(path: str, dtype: str, fast: bool, max_tokens: int, split: bool = False) -> list:  # type: ignore[type-arg]
    kwargs = dict(model=path, device="cuda", dtype=dtype, max_num_batched_tokens=48, kv_cache_memory_bytes=256 * 2**20,
                  max_model_len=512, checkpoint_interval=32)
    assert not (fast and missing_fast_path_packages()), "fast path needs fla-core and triton (hybridpd[gpu])"
    with forward_path(fast):
        if split:
            from tests.support.split_groups import split_llm

            llm = split_llm(**kwargs)
        else:
            llm = LLM(**kwargs)  # type: ignore[arg-type]
    runner = llm.engine.runner
    assert runner.fast_path is fast
    prompts = random_prompts(LENGTHS, vocab=256, seed=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    if split:  # the same prompts again: prefix hits restore checkpoints into every recurrent group
        outs += llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert any(o.num_cached_tokens > 0 for o in outs[len(prompts):])
    if fast:
        assert runner.graphs is not None and runner.graphs.num_replays > 0, "decode steps ran without CUDA graphs"
    return outs


@pytest.mark.parametrize("name", PATTERNS)
def test_fast_path_fp32_matches_reference(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    ref, fast = _generate(path, "float32", False, 32), _generate(path, "float32", True, 32)
    for a, b in zip(ref, fast, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def assert_bf16_fast_as_precise(path: str) -> None:
    truth = hf_model(path, "float32", "cuda")  # fp32 (its error, ~1e-4 at most, is far below bf16's ~1e-2)
    prompts = random_prompts(LENGTHS, vocab=256, seed=1)
    runs = {}
    for fast in (False, True):
        outs = _generate(path, "bfloat16", fast, 16)
        runs[fast] = score_under(truth, prompts, [(o.token_ids, o.logprobs) for o in outs], "cuda")
    ref, fast = runs[False], runs[True]
    assert ref["mean_lp_err"] < 0.1 and ref["max_margin"] < 2.0, f"the bf16 reference path is off: {ref}"
    assert fast["mean_lp_err"] <= 1.5 * ref["mean_lp_err"] + 1e-3, (fast, ref)
    assert fast["max_lp_err"] <= 2 * ref["max_lp_err"] + 1e-2, (fast, ref)
    assert fast["max_margin"] <= max(0.1, ref["max_margin"]), (fast, ref)


@pytest.mark.parametrize("name", PATTERNS)
def test_fast_path_bf16_as_precise_as_reference(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    assert_bf16_fast_as_precise(checkpoint_dir(name))


@pytest.mark.parametrize("widths", [{}, {"moe_intermediate_size": 17, "moe_shared_expert_intermediate_size": 45}])
def test_fast_path_moe_bf16_as_precise_as_reference(widths, tmp_path):  # type: ignore[no-untyped-def]
    """MoE through grouped GEMMs inside the decode graphs against the reference expert loop; with expert widths off
    8 (the grouped GEMM needs 16-byte rows) the fast path takes the masked expert loop instead of failing."""
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    assert_bf16_fast_as_precise(write_random_checkpoint(str(tmp_path), "nemotron_h", seed=0,
                                                        hybrid_override_pattern="M*ME", **widths))


def test_split_groups_fast_path_with_graphs_matches_reference(checkpoint_dir):  # type: ignore[no-untyped-def]
    """Two attention and two recurrent cache groups (qwen_attn_first: layers F L L L F): the fast path with CUDA
    graphs (one block table / slot buffer per group view) against the unsplit reference, fp32."""
    path = checkpoint_dir("qwen_attn_first")
    ref = _generate(path, "float32", False, 16)
    fast = _generate(path, "float32", True, 16, split=True)
    for a, b in zip(ref + ref, fast, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("name", PATTERNS)
def test_checkpoints_saved_by_decode_graphs_serve_later_hits(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    """Decode steps that save a checkpoint (every 16 tokens here) run in the CUDA graph and copy the state after the
    replay. A follow-up prompt (prompt + 30 of the answer + 5 new tokens, as a chat's next turn) then starts from a
    checkpoint saved during decode; its output equals a fresh engine's, fp32: tokens identical, logprobs 1e-4."""
    path = checkpoint_dir(name)
    kwargs = dict(model=path, device="cuda", dtype="float32", max_num_batched_tokens=64,
                  kv_cache_memory_bytes=256 * 2**20, max_model_len=256, checkpoint_interval=16)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = random_prompts([20], vocab=256, seed=4)[0]
    llm = LLM(**kwargs)  # type: ignore[arg-type]
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.num_graph_checkpoints > 0, "no checkpoint was saved by a graph step"
    follow = prompt + first.token_ids[:30] + random_prompts([5], vocab=256, seed=5)[0]
    hit = llm.generate(prompt_token_ids=[follow], sampling_params=params)[0]
    assert hit.num_cached_tokens > len(prompt), "the follow-up did not start from a checkpoint saved during decode"
    fresh = LLM(**kwargs).generate(prompt_token_ids=[follow], sampling_params=params)[0]  # type: ignore[arg-type]
    assert fresh.num_cached_tokens == 0
    assert hit.token_ids == fresh.token_ids
    assert max(abs(x - y) for x, y in zip(hit.logprobs, fresh.logprobs, strict=True)) < 1e-4
