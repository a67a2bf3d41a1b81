"""Review of the checkpoint a handoff carries as k pages (engine/transfer.py `read_blocks`, `begin_import`): what D
publishes is what P offered, byte for byte, and a prompt D later computes itself restores from it exactly as a
colocated engine restores from its own."""

from __future__ import annotations

import random

import pytest
import torch
from hybridpd.engine import SamplingParams
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.parallel.handoff import copy_import
from hybridpd.engine.transfer import (
    ImportSource,
    begin_import,
    complete_import,
    export_prefilled,
    release_export,
    schedule_local,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _core(model: str) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(path=model), cache=CacheConfig(
        block_size=BS, kv_cache_memory_bytes=8 * 2**20)))


def _run(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


def _handoff(p: EngineCore, d: EngineCore, rid: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    preq = p.add_request(rid, prompt, GREEDY, compute_target=len(prompt) - 1)
    _run(p)
    assert preq.finish_reason == "prefilled"
    exp = export_prefilled(p, preq)
    dreq = d.new_request(rid, prompt, GREEDY)
    imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
    assert imp is not None
    return preq, exp, dreq, imp


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_first"])
def test_pulled_checkpoint_is_p_s_and_restores_like_colocated(checkpoint_dir, name):  # type: ignore[no-untyped-def]
    model = checkpoint_dir(name)
    p, d, colo = _core(model), _core(model), _core(model)
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(88)]  # P's prompt-end checkpoint at 80 (the first of its prefix)
    preq, exp, dreq, imp = _handoff(p, d, "a", prompt)
    assert exp.checkpoint is not None and imp.checkpoint is not None
    k = d.cache.k
    assert len(exp.checkpoint.pages) == len(imp.checkpoint.pages) == k
    src, dst = imp.read_blocks()
    for gid in imp.dst_blocks:
        assert src[gid][-k:] == exp.checkpoint.pages and dst[gid][-k:] == imp.checkpoint.pages
    copy_import(p, d, imp)  # the in-process reference of the pull: every page read_blocks names
    rows_p, rows_d = p.runner.rows, d.runner.rows
    first_p, first_d = p.runner.arena.first_page_row, d.runner.arena.first_page_row
    for sp, dp in zip(exp.checkpoint.pages, imp.checkpoint.pages, strict=True):
        assert torch.equal(rows_p[first_p + sp], rows_d[first_d + dp])  # all of every page, not some groups' part
    complete_import(d, dreq, imp)
    release_export(p, preq, exp)
    _run(d)

    # a prompt branching at 80: D restores the pulled checkpoint, the colocated engine its own
    other = prompt[:80] + [rng.randrange(256) for _ in range(20)]
    colo.add_request("c0", prompt, GREEDY)
    _run(colo)
    want = colo.add_request("c1", other, GREEDY)
    _run(colo)
    got = d.new_request("b", other, GREEDY)
    schedule_local(d, got)
    _run(d)
    assert want.num_cached_tokens == got.num_cached_tokens == 80
    assert got.output_token_ids == want.output_token_ids
    for core in (p, d):
        core.cache.check_integrity()
        assert all(s["in_use"] == 0 for s in core.cache.pool_stats()), core.cache.pool_stats()
