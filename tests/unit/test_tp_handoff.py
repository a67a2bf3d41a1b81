"""P/D handoffs between engines of different TP sizes (P TP 1 -> D TP 2, P TP 2 -> D TP 1), through the engine's
export/import API with the planned pieces (engine.parallel.handoff: each D rank's head slice of every page rebuilt
from the P ranks' slices, a stand-in for per-rank NIXL READs): tokens equal the colocated TP 1 engine's, with
and without D's own prefix hit (no checkpoint travels between TP sizes). Models: NemotronH with 2 KV heads (split
at TP 2) and one Mamba B/C group (replicated at TP 2: conv state moved by channel ranges of x, B and C), Qwen3.5
(GDN), and a model with no attention layer (recurrent states alone)."""

from __future__ import annotations

from typing import Any

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.parallel.handoff import cache_tensors, copy_import
from hybridpd.engine.transfer import ImportSource, begin_import, complete_import, export_prefilled, release_export

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
    ("name", "tp_p", "tp_d"), [("nemotron", 1, 2), ("nemotron", 2, 1), ("qwen", 1, 2), ("states_only", 2, 1)]
)
def test_handoff_between_tp_sizes_matches_colocated(tmp_path, name, tp_p, tp_d) -> None:  # type: ignore[no-untyped-def]
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    family, overrides = MODELS[name]
    model = write_random_checkpoint(str(tmp_path), family, seed=0, **overrides)
    prompts = random_prompts([75, 75], vocab=256, seed=9)
    prompts[1] = list(prompts[0])  # the same prompt again: D hits its own blocks, pulls the rest
    want = [
        o.token_ids
        for o in LLM(model=model, kv_cache_memory_bytes=8 * 2**20).generate(
            prompt_token_ids=prompts, sampling_params=GREEDY
        )
    ]
    p, d = _core(model, tp_p), _core(model, tp_d)
    try:
        assert cache_tensors(p) != cache_tensors(d)  # the two really hold different slices
        for i, prompt in enumerate(prompts):
            preq = p.add_request(f"r{i}", prompt, GREEDY, compute_target=len(prompt) - 1)
            _run(p)
            exp = export_prefilled(p, preq)
            dreq = d.new_request(f"r{i}", prompt, GREEDY)
            imp = begin_import(d, dreq, ImportSource(exp.num_tokens, exp.blocks, exp.state_slots, exp.checkpoint))
            assert imp is not None
            # a checkpoint's pages cut the state at page bounds, not at a rank's heads: it travels between single-rank
            # engines only (test_pd_prefix_reuse): a single-rank P offers one, a TP D does not take it
            assert imp.checkpoint is None and (exp.checkpoint is None or tp_p == 1)
            copy_import(p, d, imp)
            complete_import(d, dreq, imp)
            release_export(p, preq, exp)
            _run(d)
            assert dreq.output_token_ids == want[i], f"prompt {i}"
        d.cache.check_integrity()
    finally:
        p.shutdown()
        d.shutdown()
