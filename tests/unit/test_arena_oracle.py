"""One arena through the real engine, fp32 on CPU: with a budget so small that checkpoints are written into pages
that held KV blocks and blocks are later handed out in pages that held checkpoints, greedy outputs equal
transformers and a cache-off engine, and prefix hits still happen (restoring checkpoints stored as k pages).

    budget = (1 + max_num_seqs + STAGING_SLOTS) * k * page + 48 pages
"""

from __future__ import annotations

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.cache.arena import STAGING_SLOTS

from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SEQS = 2
BLOCKS = 48


@pytest.mark.parametrize("name", ["nemotron_attn_last", "qwen_attn_first"])
def test_overlaid_memory_keeps_outputs_exact(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    path = checkpoint_dir(name)
    probe = LLM(model=path, kv_cache_memory_bytes=8 * 2**20, max_model_len=256).engine.plan
    k, block = probe.blocks_per_checkpoint, probe.bytes_per_block
    budget = (1 + SEQS + STAGING_SLOTS) * k * block + BLOCKS * block
    kw = dict(max_num_seqs=SEQS, max_num_batched_tokens=64, kv_cache_memory_bytes=budget, max_model_len=256)
    llm = LLM(model=path, **kw)
    off = LLM(model=path, enable_prefix_caching=False, **kw)
    plan, cache = llm.engine.plan, llm.engine.cache
    assert plan.attention_blocks == BLOCKS and plan.physical_bytes == budget
    assert plan.state_slots_checkpoint == (BLOCKS - 1) // k >= 2
    roles: dict[int, set[str]] = {}

    base, other, fill1, fill2, fill3, *tails = random_prompts([96, 80, 200, 180, 220, 9, 13, 5, 11, 7, 15, 6, 10],
                                                              vocab=256, seed=5)
    # long unique prompts push blocks down into the checkpoint ranges; later checkpoints land on that memory
    prompts = [fill1, base + tails[0], base + tails[1], fill2, base + tails[2], other + tails[3], other + tails[4],
               fill3, base + tails[5], other + tails[6], base + tails[7], base + tails[0]]
    hits = 0
    for prompt in prompts:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        ref_tokens, ref_lps = hf_greedy(path, prompt, NEW_TOKENS)
        assert out.token_ids == ref_tokens, (len(prompt), out.num_cached_tokens)
        assert max(abs(x - y) for x, y in zip(out.logprobs, ref_lps, strict=True)) < 1e-4
        assert out.token_ids == off.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
        hits += out.num_cached_tokens
        cache.check_integrity()
        for node in cache.tree.nodes.values():
            if node.page:
                roles.setdefault(node.page, set()).add("block")
            for p in node.ckpt or ():
                roles.setdefault(p, set()).add("ckpt")
    assert hits > 0, "no prefix hit: the checkpoints never served"
    # seen after the requests: a page cached as a block at one time and as part of a checkpoint at another
    assert sum({"block", "ckpt"} <= r for r in roles.values()) > 0, "no page held both a block and a checkpoint"
    info = llm.kv_cache_info()
    assert info["physical_bytes"] == budget and info["blocks_per_checkpoint"] == k
