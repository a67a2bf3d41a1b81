"""Engine vs transformers, fp32: greedy tokens identical, chosen-token logprobs within 1e-4.

8 prompts (1..300 tokens) in one batch with a small token budget, so prompts are cut into chunks and prefill
chunks share steps with decodes; 32 greedy tokens each; two layer patterns per family; then the same with a
cache too small for the whole batch (preemption must happen, and does)."""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.arena import STAGING_SLOTS

from tests.oracle import hf_greedy, random_prompts, reference_set

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
NEW_TOKENS = 32
PATTERNS = ["nemotron_attn_mid", "nemotron_attn_last", "qwen_attn_last", "qwen_attn_first"]


@pytest.fixture(scope="module")
def reference(checkpoint_dir):  # type: ignore[no-untyped-def]
    return lambda name: reference_set(checkpoint_dir(name), tuple(LENGTHS), NEW_TOKENS)


def assert_matches(outputs, expected) -> None:  # type: ignore[no-untyped-def]
    for i, (out, (toks, lps)) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == toks, f"prompt {i} ({LENGTHS[i]} tokens): greedy tokens differ"
        diff = max(abs(a - b) for a, b in zip(out.logprobs, lps, strict=True))
        assert diff < 1e-4, f"prompt {i}: logprob diff {diff}"


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", PATTERNS)
def test_chunked_prefill_mixed_with_decode(name, checkpoint_dir, reference):  # type: ignore[no-untyped-def]
    prompts, expected = reference(name)
    llm = LLM(model=checkpoint_dir(name), max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    stats = llm.engine.stats
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert_matches(outs, expected)
    # Chunking really happened: 1 + ... tokens needed more steps than one budget per prompt would.
    assert stats.num_steps >= sum(LENGTHS) // 48
    llm.engine.cache.check_integrity()


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_last"])
def test_preemption_keeps_outputs_identical(name, checkpoint_dir, reference):  # type: ignore[no-untyped-def]
    prompts, expected = reference(name)
    probe = LLM(model=checkpoint_dir(name), kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    info = probe.kv_cache_info()
    per_block = info["bytes_per_token"] * info["block_size"]
    # one arena: only the null, running and staging slots are reserved, k whole pages each
    state = (1 + 8 + STAGING_SLOTS) * info["blocks_per_checkpoint"] * info["bytes_per_block"]
    # room for 48 blocks = 768 tokens: far less than the batch needs (~1,000 prompt + 256 generated tokens)
    budget = state + 48 * per_block
    llm = LLM(model=checkpoint_dir(name), max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False,
              kv_cache_memory_bytes=budget, num_checkpoint_slots=16, max_model_len=512)
    assert llm.kv_cache_info()["attention_blocks"] == 48
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small: no preemption happened"
    assert_matches(outs, expected)
    llm.engine.cache.check_integrity()


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_first"])
def test_prefix_caching_on_matches(name, checkpoint_dir, reference):  # type: ignore[no-untyped-def]
    """Repeated prompts with prefix caching on: identical to the reference, and the hit is exactly the last block
    boundary <= N-1 (where the first run saved its prompt-end checkpoint; the interval adds more below it)."""
    prompts, expected = reference(name)
    llm = LLM(model=checkpoint_dir(name), max_num_batched_tokens=64, checkpoint_interval=32,
              kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    first = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert_matches(first, expected)
    second = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert_matches(second, expected)
    for p, out in zip(prompts, second, strict=True):
        assert out.num_cached_tokens == ((len(p) - 1) // 16) * 16, (len(p), out.num_cached_tokens)
    llm.engine.cache.check_integrity()


@pytest.mark.parametrize("name", ["nemotron_attn_last", "qwen_attn_last"])
def test_shared_prefix_and_two_turn_chat_hit_exactly(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    """Prefix caching on, checkpoint interval 32, block 16: a prompt sharing 100 tokens with an earlier one hits
    96 (the last checkpoint inside the 6 shared full blocks); the second turn of a chat hits the checkpoint its
    first turn wrote while *decoding* (96 tokens). Outputs identical to transformers and to a cache-off run."""
    path = checkpoint_dir(name)
    base, tail_a, tail_b, user2 = random_prompts([100, 20, 35, 15], vocab=256, seed=5)
    a, b = base + tail_a, base + tail_b
    turn1 = random_prompts([70], vocab=256, seed=6)[0]
    llm = LLM(model=path, checkpoint_interval=32, max_num_batched_tokens=64, kv_cache_memory_bytes=32 * 2**20,
              max_model_len=512)
    off = LLM(model=path, enable_prefix_caching=False, kv_cache_memory_bytes=32 * 2**20, max_model_len=512)

    def check(prompt: list[int], expect_cached: int) -> list[int]:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        ref_tokens, ref_lps = hf_greedy(path, prompt, NEW_TOKENS)
        assert out.token_ids == ref_tokens
        assert max(abs(x - y) for x, y in zip(out.logprobs, ref_lps, strict=True)) < 1e-4
        assert out.token_ids == off.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
        assert out.num_cached_tokens == expect_cached, (len(prompt), out.num_cached_tokens)
        return out.token_ids

    check(a, 0)
    check(b, 96)
    reply = check(turn1, 0)
    check(turn1 + reply + user2, 96)  # 70 + 32 + 15 tokens; first turn computed 101 -> checkpoint at 96
    llm.engine.cache.check_integrity()
