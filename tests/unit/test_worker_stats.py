"""The Stats RPC a worker answers (worker/convert.stats_response) from a real engine: pool counts with their
integrity, queue lengths, and the cache memory as planned and as split now (`/v1/cluster` shows the
split live)."""

from __future__ import annotations

from hybridpd.engine import LLM, SamplingParams
from hybridpd.worker.convert import stats_response


def test_stats_report_the_live_memory_split() -> None:
    llm = LLM(kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    core = llm.engine
    before = stats_response(core, "decode", "w0", "e0", 0)
    assert before.num_running == before.num_waiting == 0
    assert all(p.integrity_ok and p.in_use == 0 and p.cached == 0 for p in before.pools)
    mem = dict(before.memory_bytes)
    assert mem["physical_bytes"] == core.plan.physical_bytes > 0
    assert mem["attention_bytes_cached"] == 0 and mem.get("checkpoint_bytes_held", 0) == 0

    prompt = list(range(3, 3 + 200))
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0))
    after = stats_response(core, "decode", "w0", "e0", 0, extra_waiting=2)
    assert after.num_waiting == 2 and after.num_running == 0
    mem = dict(after.memory_bytes)
    arena, cache = core.plan.arena, core.cache
    assert arena is not None  # the planner always builds one
    (attn,) = [p for p in after.pools if p.kind == "attention"]
    (rec,) = [p for p in after.pools if p.kind != "attention"]
    ckpt_pages = cache.pages.num_checkpoint_pages
    # request end and prompt end saved checkpoints: k pages each, and their memory is held
    assert rec.cached == cache.tree.num_checkpoints > 0 and ckpt_pages == rec.cached * arena.pages_per_state
    assert mem["checkpoint_bytes_held"] == ckpt_pages * arena.page_bytes > 0
    # the attention group's cached pages are cached blocks (the prompt stays cached) and those checkpoint pages
    blocks = attn.cached - ckpt_pages
    (group,) = [g for g in core.groups if g.is_attention]
    assert blocks > 0 and mem["attention_bytes_cached"] == blocks * group.page_bytes_all_layers
    assert attn.in_use == rec.in_use == 0 and attn.free + attn.cached == attn.total
    assert all(p.integrity_ok for p in after.pools)
