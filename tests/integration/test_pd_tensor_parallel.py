"""PD between tensor-parallel workers over real processes, gRPC and NIXL (DRAM, one agent per rank): P TP 1 -> D TP 2
(NemotronH: 2 KV heads split on D, one Mamba B/C group replicated), P TP 2 -> D TP 1 (Qwen3.5: GDN and attention
heads) and P TP 2 -> D TP 2 (NemotronH, sliced alike: P's checkpoint travels too, rank to rank), token-identical in
fp32 to the colocated TP 1 engine, every prompt handed off. A D worker whose cache layout differs from P's refuses
it at connect time and computes locally."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hybridpd.engine import LLM, SamplingParams

from tests.integration.cluster import complete, start_cluster
from tests.oracle import random_prompts

pytestmark = pytest.mark.slow
NEW = 6
LENGTHS = [17, 40, 75]
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron": ("nemotron_h", {"hybrid_override_pattern": "M*E-M", "num_key_value_heads": 2, "n_groups": 1}),
    "qwen": ("qwen3_5", {"layer_types": ["linear_attention", "full_attention", "linear_attention"]}),
}
WORKER = ["--checkpoint-interval", "32", "--block-size", "16", "--kv-cache-memory-bytes", str(8 * 2**20)]


def _model(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    family, overrides = MODELS[name]
    return write_random_checkpoint(str(tmp_path_factory.mktemp(name)), family, seed=0, **overrides)


def _tp(n: int) -> list[str]:
    return ["--tensor-parallel-size", str(n)] if n > 1 else []


@pytest.fixture(
    scope="module",
    params=[("nemotron", 1, 2), ("qwen", 2, 1), ("nemotron", 2, 2)],
    ids=["nemotron-p1-d2", "qwen-p2-d1", "nemotron-p2-d2"],
)
def tp_cluster(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    name, tp_p, tp_d = request.param
    model = _model(tmp_path_factory, name)
    c = start_cluster(
        model,
        worker_args=WORKER,
        prefill_args=_tp(tp_p),
        decode_args=_tp(tp_d),
        decode_env={"OMP_NUM_THREADS": "1"},
        prefill_env={"OMP_NUM_THREADS": "1"},
    )
    c.tp_sizes = (tp_p, tp_d)
    yield c
    c.stop()


def _handoff_failures(cluster) -> float:  # type: ignore[no-untyped-def]
    text = httpx.get(f"http://127.0.0.1:{cluster.decode[0].info['metrics_port']}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hybridpd_kv_transfer_failures_total{")
    )


def test_pd_between_tp_sizes_matches_colocated(tp_cluster) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts(LENGTHS, vocab=256, seed=7)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    want = [
        o.token_ids
        for o in LLM(
            model=tp_cluster.model, checkpoint_interval=32, block_size=16, kv_cache_memory_bytes=8 * 2**20
        ).generate(prompt_token_ids=prompts, sampling_params=greedy)
    ]
    for prompt, tokens in zip(prompts, want, strict=True):
        body = complete(tp_cluster, prompt, NEW)
        assert body["choices"][0]["token_ids"] == tokens, f"{len(prompt)}-token prompt: PD output differs"
        assert body["usage"]["hybridpd"]["transferred_tokens"] == len(prompt)  # pulled, not recomputed
    assert _handoff_failures(tp_cluster) == 0


def test_a_repeated_prompt_hits_the_checkpoint_only_between_workers_sliced_alike(tp_cluster) -> None:  # type: ignore[no-untyped-def]
    """The same 200-token prompt twice: the second hits D's own blocks (192 tokens) and, where P's checkpoint could
    travel (equal TP sizes: its pages line up rank to rank), the recurrent state at 160 tokens too (P's prompt-end
    checkpoint gives way to the shallower 32-token-interval one, engine.transfer.offered_checkpoint). Between
    different TP sizes D caches no checkpoint from P. The output is the colocated engine's either way."""
    d = tp_cluster.decode[0]
    prompt = random_prompts([200], vocab=256, seed=99)[0]
    want = LLM(model=tp_cluster.model, checkpoint_interval=32, block_size=16, kv_cache_memory_bytes=8 * 2**20).generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    )[0].token_ids
    first = complete(tp_cluster, prompt, NEW)
    hits1 = tp_cluster.metric(d, "hybridpd_prefix_cache_hits_total", role="decode")
    second = complete(tp_cluster, prompt, NEW)
    hits2 = tp_cluster.metric(d, "hybridpd_prefix_cache_hits_total", role="decode")
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == want
    assert second["usage"]["hybridpd"]["decode_local_cached_tokens"] == 192
    alike = tp_cluster.tp_sizes[0] == tp_cluster.tp_sizes[1]
    assert hits2 - hits1 == 192 + (160 if alike else 0)
    assert _handoff_failures(tp_cluster) == 0
