"""Prefix cache v2 through the real engine, fp32 on CPU: greedy outputs with hits equal transformers and a cache-off
engine, and the hits land where the reuse admission put checkpoints (default config: no interval at all).

    a = base(100) + tail_a        first: saves its prompt end (112) and, while decoding, its rolling end
    b = base(100) + tail_b        branch point at 96 (6 full shared blocks): saves it, hits nothing yet
    c = base(100) + tail_c        hits the branch point: 96
    a again                       hits a's prompt end at (N-1) // 16 * 16 = 112
    chat turn 2 = turn 1 + reply + user   hits turn 1's rolling end: floor(computed / 16) * 16
"""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams

from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", ["nemotron_attn_last", "qwen_attn_first"])
def test_reuse_admission_hits_and_matches_the_oracle(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    base, tail_a, tail_b, tail_c, turn1, user2 = random_prompts([100, 20, 35, 9, 70, 15], vocab=256, seed=11)
    llm = LLM(model=path, max_num_batched_tokens=64, kv_cache_memory_bytes=32 * 2**20, max_model_len=512)
    off = LLM(model=path, enable_prefix_caching=False, kv_cache_memory_bytes=32 * 2**20, max_model_len=512)
    assert llm.engine.cache.admission.name == "reuse" and llm.engine.cache.policy.interval == 0
    assert llm.engine.cache.tree is not None

    def check(prompt: list[int], expect_cached: int) -> list[int]:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        ref_tokens, ref_lps = hf_greedy(path, prompt, NEW_TOKENS)
        assert out.token_ids == ref_tokens
        assert max(abs(x - y) for x, y in zip(out.logprobs, ref_lps, strict=True)) < 1e-4
        assert out.token_ids == off.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
        assert out.num_cached_tokens == expect_cached, (len(prompt), out.num_cached_tokens)
        llm.engine.cache.check_integrity()
        return out.token_ids

    check(base + tail_a, 0)
    check(base + tail_b, 0)  # the branch point (96) is seen now and saved while b prefills
    check(base + tail_c, 96)
    check(base + tail_a, 112)  # 120 tokens: the prompt end 112 <= N - 1
    reply = check(turn1, 0)
    computed = len(turn1) + NEW_TOKENS - 1  # the last sampled token is never computed
    check(turn1 + reply + user2, computed // 16 * 16)
    info = llm.kv_cache_info()
    assert info["checkpoint_bytes_held"] > 0 and info["mamba2_bytes_cached" if "nemotron" in name else
                                             "gated_deltanet_bytes_cached"] > 0
