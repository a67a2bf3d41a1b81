"""The oracle on a GPU: fp32 exact as on CPU (tokens identical, logprobs within 1e-4); bf16: the first 8 greedy
tokens of each prompt identical and logprobs within 2e-2 of transformers' bf16 run on the same device."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.gpu

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
PATTERNS = ["nemotron_attn_mid", "nemotron_attn_last", "qwen_attn_last", "qwen_attn_first"]


@pytest.mark.parametrize("name", PATTERNS)
def test_cuda_fp32_matches_transformers(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    prompts = random_prompts(LENGTHS, vocab=256, seed=1)
    llm = LLM(model=path, device="cuda", dtype="float32", max_num_batched_tokens=48, kv_cache_memory_bytes=256 * 2**20,
              max_model_len=512)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        toks, lps = hf_greedy(path, p, 32, "float32", "cuda")
        assert o.token_ids == toks
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps, strict=True)) < 1e-4


@pytest.mark.parametrize("name", PATTERNS)
def test_cuda_bf16_close_to_transformers(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    prompts = random_prompts(LENGTHS, vocab=256, seed=1)
    llm = LLM(model=path, device="cuda", dtype="bfloat16", max_num_batched_tokens=48,
              kv_cache_memory_bytes=256 * 2**20, max_model_len=512)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        toks, lps = hf_greedy(path, p, 8, "bfloat16", "cuda")
        assert o.token_ids == toks
        assert max(abs(a - b) for a, b in zip(o.logprobs, lps, strict=True)) < 2e-2
