"""Models without attention layers (only Mamba-2 / Gated-DeltaNet mixers, MLPs, MoE): the cache plans recurrent
states only, named at the engine's block size. fp32 greedy tokens identical to transformers and logprobs within
1e-4, with chunked prefill mixed with decodes and a second round that restores checkpoints of the first."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.models.checkpoint import write_random_checkpoint

from tests.oracle import hf_greedy_uncached, random_prompts

MODELS = {
    "nemotron_mamba_mlp": ("nemotron_h", {"hybrid_override_pattern": "M-ME"}),
    "qwen_gdn_only": ("qwen3_5", {"layer_types": ["linear_attention", "linear_attention"]}),
}
NEW = 6


@pytest.mark.parametrize("name", sorted(MODELS))
def test_states_only_model_matches_transformers(name, tmp_path):  # type: ignore[no-untyped-def]
    family, overrides = MODELS[name]
    path = write_random_checkpoint(str(tmp_path), family, seed=2, **overrides)
    prompts = random_prompts([5, 37, 70], 500, seed=4)
    again = [prompts[2] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]  # its first 64 tokens restore a checkpoint
    llm = LLM(model=path, max_num_batched_tokens=32, kv_cache_memory_bytes=8 << 20, max_model_len=256)
    try:
        info = llm.kv_cache_info()
        assert info["attention_blocks"] == 0 and info["block_size"] > 0
        greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        outs += llm.generate(prompt_token_ids=again, sampling_params=greedy)
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts + again, outs, strict=True):
        toks, lps = hf_greedy_uncached(path, prompt, NEW)
        assert out.token_ids == toks, f"{len(prompt)}-token prompt: greedy tokens differ"
        assert max(abs(a - b) for a, b in zip(out.logprobs, lps, strict=True)) < 1e-4
    assert outs[-1].num_cached_tokens > 0, "the second round found no checkpoint of the first"
