"""Prefix reuse on the consumer under PD (P and D run the same policy, D keeps what it pulls, hits on D
count by group). Two EngineCores of one tiny model, a copy standing in for NIXL, on a prefix-repetition workload
shaped like `serve_compare.py`'s (shared prefix, then a unique suffix whose prompt end is past the prefix's last
block): D must hold the shared prefix's blocks *and* its checkpoint after the second request of a prefix, pull
only the suffix from then on, and count the same per-group hits as a colocated engine; tokens equal colocated."""

from __future__ import annotations

import random

import pytest
import torch
from hybridpd.engine import SamplingParams
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.transfer import ImportSource, begin_import, complete_import, export_prefilled, release_export

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS, PREFIX, SUFFIX = 16, 64, 24  # N - 1 = 87: P's prompt-end checkpoint at 80, past the branch point at 64
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _core(model: str) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(path=model), cache=CacheConfig(
        block_size=BS, kv_cache_memory_bytes=8 * 2**20)))


def _run(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


def _prompts(num_prefixes: int, per_prefix: int) -> list[list[int]]:
    rng = random.Random(15)
    prefixes = [[rng.randrange(256) for _ in range(PREFIX)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(256) for _ in range(SUFFIX)]
            for i in range(num_prefixes * per_prefix)]


class PD:
    """P, D and a colocated engine side by side; `serve` hands one prompt over and records what moved."""

    def __init__(self, model: str) -> None:
        self.p, self.d, self.colo = _core(model), _core(model), _core(model)
        self.offers: list[int | None] = []
        self.imports = []  # type: ignore[var-annotated]

    def serve(self, rid: str, prompt: list[int]) -> None:
        preq = self.p.add_request(rid, prompt, GREEDY, compute_target=len(prompt) - 1)
        _run(self.p)
        assert preq.finish_reason == "prefilled"
        exp = export_prefilled(self.p, preq)
        self.offers.append(exp.checkpoint.num_tokens if exp.checkpoint else None)
        dreq = self.d.new_request(rid, prompt, GREEDY)
        imp = begin_import(self.d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
        assert imp is not None
        self.imports.append(imp)
        # (read_blocks: the blocks and the pulled checkpoint's pages, as a READ moves them)
        for src_map, dst_map in (imp.read_blocks(), (imp.src_state_slots, imp.dst_state_slots)):
            for gid, src in src_map.items():
                s, t = torch.tensor(src, dtype=torch.long), torch.tensor(dst_map[gid], dtype=torch.long)
                for ps, ds in zip(self.p.runner.group_tensors[gid], self.d.runner.group_tensors[gid], strict=True):
                    ds.index_copy_(0, t, ps.index_select(0, s))
        complete_import(self.d, dreq, imp)
        release_export(self.p, preq, exp)
        _run(self.d)
        creq = self.colo.add_request(rid, prompt, GREEDY)
        _run(self.colo)
        assert dreq.output_token_ids == creq.output_token_ids


def test_producer_offers_the_shared_prefix_checkpoint(checkpoint_dir):  # type: ignore[no-untyped-def]
    pd = PD(checkpoint_dir("nemotron_attn_mid"))
    for i, prompt in enumerate(_prompts(1, 3)):
        pd.serve(f"r{i}", prompt)
    # first of its prefix: nothing shared yet, its prompt end (80) is all there is; then the branch point (64)
    assert pd.offers == [80, PREFIX, PREFIX]


def test_consumer_keeps_its_blocks_without_a_checkpoint(checkpoint_dir):  # type: ignore[no-untyped-def]
    pd = PD(checkpoint_dir("nemotron_attn_mid"))
    for i, prompt in enumerate(_prompts(1, 2)):
        pd.serve(f"r{i}", prompt)
    # r1: D holds the prefix's blocks (from r0) but no checkpoint at 64: the running state comes from P anyway
    first, second = pd.imports
    assert first.local_hit_tokens == 0
    assert second.local_hit_tokens == PREFIX
    for ids in second.src_blocks.values():
        assert len(ids) == -(-(PREFIX + SUFFIX - 1) // BS) - PREFIX // BS  # only the suffix's blocks are read


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_first"])
def test_consumer_hits_like_colocated_on_prefix_repetition(checkpoint_dir, name):  # type: ignore[no-untyped-def]
    pd = PD(checkpoint_dir(name))
    prompts = _prompts(2, 3)
    for i, prompt in enumerate(prompts):
        pd.serve(f"r{i}", prompt)
    for imp in pd.imports[4:]:  # third request of each prefix: D has blocks and checkpoint, pulls the suffix only
        assert imp.local_hit_tokens == PREFIX
        assert imp.checkpoint is None
    d, colo = pd.d.cache.counters, pd.colo.cache.counters
    assert {k: (c.hits, c.queries) for k, c in d.items()} == {k: (c.hits, c.queries) for k, c in colo.items()}
    assert all(c.hits > 0 for c in d.values())  # every group hits on D, recurrent ones included
    ext = pd.d.cache.external_counters
    pulled = sum(len(p) - 1 for p in prompts) - sum(imp.local_hit_tokens for imp in pd.imports)
    assert all(c.hits == pulled for c in ext.values())
    for core in (pd.p, pd.d, pd.colo):
        core.cache.check_integrity()
        assert all(s["in_use"] == 0 for s in core.cache.pool_stats()), core.cache.pool_stats()
