"""P/D handoffs between engines of different TP sizes (P TP 1 -> D TP 2, P TP 2 -> D TP 1), through the engine's
export/import API with the planned pieces (engine.parallel.handoff: each D rank's head slice of every page rebuilt
from the P ranks' slices, a stand-in for per-rank NIXL READs): tokens equal the colocated TP 1 engine's, with
and without D's own prefix hit. A checkpoint's pages cut the state at page bounds, not at a rank's heads: between
engines sliced differently D's worker drops P's offer, and the page copy refuses one (equal TP sizes, where it
travels, need two tensor-parallel engines: processes of their own, tests/integration/test_pd_tensor_parallel.py;
here TP 1 -> TP 1 shows D restoring a later prompt from the checkpoint it pulled).
Models: NemotronH with 2 KV heads (split at TP 2) and one Mamba B/C group (replicated at TP 2: conv state moved by
channel ranges of x, B and C), Qwen3.5 (GDN), and a model with no attention layer (recurrent states alone)."""

from __future__ import annotations

from typing import Any

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.parallel.handoff import cache_tensors, copy_import
from hybridpd.engine.transfer import (
    ImportSource,
    abort_import,
    begin_import,
    complete_import,
    export_prefilled,
    release_export,
)
from hybridpd.kvtransfer.tp_slices import in_group_order, same_slicing

from tests.oracle import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron": ("nemotron_h", {"hybrid_override_pattern": "M*E-M", "num_key_value_heads": 2, "n_groups": 1}),
    "qwen": ("qwen3_5", {"layer_types": ["linear_attention", "full_attention", "linear_attention"]}),
    "states_only": ("nemotron_h", {"hybrid_override_pattern": "M-M"}),
}


def _core(model: str, tp: int) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(path=model),
            parallel=ParallelConfig(tensor_parallel_size=tp),
            cache=CacheConfig(block_size=16, checkpoint_interval=32, kv_cache_memory_bytes=8 * 2**20),
        )
    )


def _run(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


@pytest.mark.parametrize(
    ("name", "tp_p", "tp_d"),
    [("nemotron", 1, 2), ("nemotron", 2, 1), ("qwen", 1, 2), ("states_only", 2, 1), ("nemotron", 1, 1)],
)
def test_handoff_between_tp_sizes_matches_colocated(tmp_path, name, tp_p, tp_d) -> None:  # type: ignore[no-untyped-def]
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    family, overrides = MODELS[name]
    model = write_random_checkpoint(str(tmp_path), family, seed=0, **overrides)
    prompts = random_prompts([75, 75], vocab=256, seed=9)
    prompts[1] = list(prompts[0])  # the same prompt again: D hits its own blocks, pulls the rest
    p, d = _core(model, tp_p), _core(model, tp_d)
    alike = same_slicing(in_group_order(cache_tensors(d)), in_group_order(cache_tensors(p)))
    assert alike == (tp_p == tp_d)  # otherwise the two really hold different slices
    traveled, guarded = None, []
    try:
        outputs = []
        for i, prompt in enumerate(prompts):
            preq = p.add_request(f"r{i}", prompt, GREEDY, compute_target=len(prompt) - 1)
            _run(p)
            exp = export_prefilled(p, preq)
            dreq = d.new_request(f"r{i}", prompt, GREEDY)
            if exp.checkpoint is not None and not alike:  # D's worker drops such an offer (consumer.source_of) ...
                imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
                assert imp is not None
                if imp.checkpoint is not None:  # ... and were it taken (same k), its pages would never land sliced
                    guarded.append(i)
                    with pytest.raises(ValueError, match="slice every tensor alike"):
                        copy_import(p, d, imp)
                abort_import(d, dreq, imp, reusable=True)
                dreq = d.new_request(f"r{i}", prompt, GREEDY)
            offer = exp.checkpoint if alike else None
            imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, offer))
            assert imp is not None
            if i == 0:  # the first prompt of its prefix: P offers its checkpoint (pages are blocks on every rank)
                assert (imp.checkpoint is not None) == alike == (exp.checkpoint is not None and alike)
                traveled = exp.checkpoint if alike else None
            copy_import(p, d, imp)
            complete_import(d, dreq, imp)
            release_export(p, preq, exp)
            _run(d)
            outputs.append(dreq.output_token_ids)
        if traveled is not None:  # a prompt that leaves the first one past the checkpoint, run on D alone: it
            n = traveled.num_tokens  # restores the state P computed and D pulled
            branch = prompts[0][:n] + [(t + 1) % 250 + 1 for t in prompts[0][n : n + 9]]
            prompts.append(branch)
            breq = d.add_request("branch", branch, GREEDY)
            _run(d)
            assert breq.num_cached_tokens == n
            outputs.append(breq.output_token_ids)
        d.cache.check_integrity()
    finally:
        p.shutdown()
        d.shutdown()
    if name == "nemotron" and not alike:  # D's engine would take the offer (same k): the guard kept it out
        assert guarded == [0, 1]
    want = [
        o.token_ids
        for o in LLM(model=model, kv_cache_memory_bytes=8 * 2**20).generate(
            prompt_token_ids=prompts, sampling_params=GREEDY
        )
    ]
    assert outputs == want
