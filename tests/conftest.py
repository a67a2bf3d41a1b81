"""Shared fixtures: random-weight checkpoints (written once per session) and the transformers reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# name -> (family, overrides). Two layer patterns per family: attention early vs late, several recurrent in a row.
CHECKPOINTS = {
    "nemotron_attn_mid": ("nemotron_h", {"hybrid_override_pattern": "M*-MM-"}),
    "nemotron_attn_last": ("nemotron_h", {"hybrid_override_pattern": "MMM-M*"}),
    "qwen_attn_last": ("qwen3_5", {"layer_types": ["linear_attention", "linear_attention", "linear_attention",
                                                   "full_attention"]}),
    "qwen_attn_first": ("qwen3_5", {"layer_types": ["full_attention", "linear_attention", "linear_attention",
                                                    "linear_attention", "full_attention"]}),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            family, overrides = CHECKPOINTS[name]
            out = tmp_path_factory.mktemp(name)
            cache[name] = str(write_random_checkpoint(str(out), family, seed=0, **overrides))
        return cache[name]

    return get


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CI has none; run on the GPU box, figures in docs/BENCHMARKS.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():  # type: ignore[no-untyped-def]
    """For modules of tiny models (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): intra-op threads only
    add synchronisation there (on a loaded 2-core box, 2 threads ran such a module several times slower than 1).
    Restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
