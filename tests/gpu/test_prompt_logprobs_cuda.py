"""Prompt logprobs on a GPU, fp32: the batched fast path (fla-core kernels, decode steps in CUDA graphs; a step that
scores prompt rows runs eagerly) against transformers within 1e-4, over 48-token chunks, with the prompts already in
the prefix cache, scored and plain requests in one batch."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams

from tests.oracle import hf_model, random_prompts

pytestmark = pytest.mark.gpu

LENGTHS = [1, 7, 33, 129, 300]
K = 5


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_last"])
def test_cuda_fp32_prompt_logprobs_match_transformers(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    prompts = random_prompts(LENGTHS, vocab=256, seed=4)
    llm = LLM(
        model=path,
        device="cuda",
        dtype="float32",
        max_num_batched_tokens=48,
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
    )
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=plain)  # every prompt cached
    scored = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(
        prompt_token_ids=prompts + prompts, sampling_params=[scored] * len(prompts) + [plain] * len(prompts)
    )
    model = hf_model(path, "float32", "cuda")
    for ids, out in zip(prompts, outs, strict=False):
        assert out.num_cached_tokens == 0 and out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float(), -1)
        for i in range(1, len(ids)):
            row, want = out.prompt_logprobs[i], ref[i - 1]
            assert row is not None and abs(row[ids[i]].logprob - want[ids[i]].item()) < 1e-4
            top = want.topk(K)
            assert all(
                abs(row[t].logprob - v) < 1e-4 for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            )
    assert all(o.prompt_logprobs is None for o in outs[len(prompts) :])
    llm.engine.cache.check_integrity()
