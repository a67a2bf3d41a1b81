"""test_poison.py on the GPU: the batched fast path with CUDA graphs, every free (unhashed) attention block and
state slot, the null block and the null slot overwritten with NaN / 1e30 before every step, fp32, 8 prompts of
1..300 tokens chunked by a 48-token budget and mixed with decodes. Greedy tokens must equal transformers' on the
same GPU and logprobs stay within 1e-4, with zeroing on (the default for hybrids) and off (the fast path's paged
attention and recurrent kernels must not depend on zeroing), and a second pass with prefix hits stays exact."""

from __future__ import annotations

import math

import pytest
from hybridpd.engine import LLM, SamplingParams

from tests.oracle import hf_greedy, random_prompts
from tests.unit.test_poison import POISONS, Poisoner

pytestmark = pytest.mark.gpu

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
NEW_TOKENS = 16
FAMILIES = ["nemotron_attn_mid", "qwen_attn_first"]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
_REFERENCE: dict[str, list] = {}


def reference(path: str) -> tuple[list[list[int]], list]:
    prompts = random_prompts(LENGTHS, vocab=256, seed=1)
    if path not in _REFERENCE:
        _REFERENCE[path] = [hf_greedy(path, p, NEW_TOKENS, "float32", "cuda") for p in prompts]
    return prompts, _REFERENCE[path]


def assert_matches(outputs, expected) -> None:  # type: ignore[no-untyped-def]
    for i, (out, (toks, lps)) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == toks, f"prompt {i} ({LENGTHS[i]} tokens): greedy tokens differ"
        assert all(math.isfinite(lp) for lp in out.logprobs), f"prompt {i}: non-finite logprob"
        assert max(abs(a - b) for a, b in zip(out.logprobs, lps, strict=True)) < 1e-4, f"prompt {i}"


def cuda_llm(path: str, **kw) -> LLM:  # type: ignore[no-untyped-def]
    llm = LLM(model=path, device="cuda", dtype="float32", max_num_batched_tokens=48, max_num_seqs=8,
              kv_cache_memory_bytes=256 * 2**20, max_model_len=512, **kw)
    assert llm.engine.runner.fast_path and llm.engine.runner.graphs is not None, "not the path under test"
    return llm


@pytest.mark.parametrize("zeroing", ["auto", "off"])
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("name", FAMILIES)
def test_poisoned_free_caches_cuda(name, poison, zeroing, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    prompts, expected = reference(path)
    llm = cuda_llm(path, enable_prefix_caching=False, zero_fresh_blocks=zeroing)
    poisoner = Poisoner(llm.engine, POISONS[poison])
    assert_matches(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY), expected)
    assert poisoner.fresh_blocks == poisoner.fresh_blocks_poisoned > 0
    assert poisoner.new_slots == poisoner.new_slots_poisoned == len(prompts)
    llm.engine.cache.check_integrity()


@pytest.mark.parametrize("name", FAMILIES)
def test_prefix_hits_survive_poisoned_neighbours_cuda(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    prompts, expected = reference(path)
    llm = cuda_llm(path, checkpoint_interval=32, num_checkpoint_slots=64)
    poisoner = Poisoner(llm.engine, POISONS["nan"])
    assert_matches(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY), expected)
    second = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert_matches(second, expected)
    assert sum(o.num_cached_tokens for o in second) > 0, "the second pass was meant to hit"
    assert poisoner.fresh_blocks_poisoned > 0 and poisoner.new_slots_poisoned > 0
    llm.engine.cache.check_integrity()
