"""engine/transfer.py, the engine's export/import API, on two EngineCores of one tiny model with a copy standing in
for NIXL: export on P, import on D (with and without D's own prefix hit), abort paths, bad sources. Tokens must
equal the colocated engine's; pools must be consistent and empty afterwards."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.transfer import (
    Import,
    ImportSource,
    abort_import,
    add_first_token,
    begin_import,
    complete_import,
    export_prefilled,
    first_token_problem,
    release_export,
    schedule_local,
)

from tests.oracle import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _core(model: str) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(path=model), cache=CacheConfig(
        block_size=16, checkpoint_interval=32, kv_cache_memory_bytes=8 * 2**20)))


def _run(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


def _copy(p: EngineCore, d: EngineCore, imp: Import) -> None:
    for src_map, dst_map in (imp.read_blocks(), (imp.src_state_slots, imp.dst_state_slots)):  # (checkpoint pages too)
        for gid, src in src_map.items():
            s, t = torch.tensor(src), torch.tensor(dst_map[gid])
            for ps, ds in zip(p.runner.group_tensors[gid], d.runner.group_tensors[gid], strict=True):
                ds.index_copy_(0, t, ps.index_select(0, s))


def _source(exp) -> ImportSource:  # type: ignore[no-untyped-def]
    return ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint)


def _idle_and_empty(core: EngineCore) -> None:
    core.cache.check_integrity()
    assert not core.has_unfinished()
    assert all(s["in_use"] == 0 for s in core.cache.pool_stats()), core.cache.pool_stats()


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_first"])
def test_export_import_matches_colocated_with_and_without_a_local_hit(checkpoint_dir, name):  # type: ignore[no-untyped-def]
    model = checkpoint_dir(name)
    prompts = random_prompts([75, 75], vocab=256, seed=9)
    prompts[1] = list(prompts[0])  # the same prompt again: D has its blocks and checkpoints by then
    want = [o.token_ids for o in LLM(model=model, kv_cache_memory_bytes=8 * 2**20).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY)]
    p, d = _core(model), _core(model)
    for i, prompt in enumerate(prompts):
        preq = p.add_request(f"r{i}", prompt, GREEDY, prefill_only=True)  # the whole prompt, then token 1
        _run(p)
        assert preq.finish_reason == "prefilled" and preq.output_token_ids == want[i][:1]
        exp = export_prefilled(p, preq)
        assert exp.num_tokens == len(prompt)
        dreq = d.new_request(f"r{i}", prompt, GREEDY)
        assert first_token_problem(d, dreq, preq.output_token_ids[0]) is None
        imp = begin_import(d, dreq, _source(exp))
        add_first_token(d, dreq, preq.output_token_ids[0], preq.output_logprobs[0])
        assert imp is not None
        (gid,) = imp.src_blocks
        assert imp.local_hit_tokens % 16 == 0
        assert imp.src_blocks[gid] == exp.blocks[gid][imp.local_hit_tokens // 16:]  # D reads only what it lacks
        if i == 1:
            assert imp.local_hit_tokens > 0
        _copy(p, d, imp)
        complete_import(d, dreq, imp)
        release_export(p, preq, exp)
        _run(d)
        assert dreq.output_token_ids == want[i]
        assert dreq.external_computed_tokens == len(prompt) - imp.local_hit_tokens
    _idle_and_empty(p)
    _idle_and_empty(d)


def test_aborted_or_refused_imports_give_everything_back(checkpoint_dir):  # type: ignore[no-untyped-def]
    model = checkpoint_dir("nemotron_attn_mid")
    (prompt,) = random_prompts([80], vocab=256, seed=10)
    want = LLM(model=model, kv_cache_memory_bytes=8 * 2**20).generate(
        prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    p, d = _core(model), _core(model)
    preq = p.add_request("r", prompt, GREEDY, compute_target=len(prompt) - 1)
    _run(p)
    exp = export_prefilled(p, preq)

    # a source naming the wrong number of blocks: refused, nothing kept
    (gid,) = exp.blocks
    bad = ImportSource(exp.num_tokens, {gid: exp.blocks[gid][:-1]}, _source(exp).state_slots, exp.checkpoint)
    with pytest.raises(ValueError):
        begin_import(d, d.new_request("bad", prompt, GREEDY), bad)
    _idle_and_empty(d)

    # the pull failed (or P refused the commit): garbage in the pages is never published nor used
    dreq = d.new_request("r", prompt, GREEDY)
    imp = begin_import(d, dreq, _source(exp))
    assert imp is not None
    for ids in imp.dst_blocks.values():
        for t in d.runner.group_tensors[gid]:
            t[list(ids)] = float("nan")
    assert abort_import(d, dreq, imp, reusable=True)
    schedule_local(d, dreq)
    _run(d)
    assert dreq.output_token_ids == want and dreq.num_cached_tokens == 0

    # a READ that could not be cancelled: the pages stay out of use
    dreq2 = d.new_request("r2", prompt, GREEDY)
    imp2 = begin_import(d, dreq2, _source(exp))
    assert imp2 is not None
    assert not abort_import(d, dreq2, imp2, reusable=False)
    assert any(s["in_use"] for s in d.cache.pool_stats())  # quarantined, not handed out again
    release_export(p, preq, exp)
    _idle_and_empty(p)
