"""Shared fixtures: random-weight checkpoints (written once per session) and the transformers reference."""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process, for this process and every process a test starts (they inherit it): the test
# models are tiny, so threads only add synchronisation, and on the 2-core CI box two xdist workers plus the workers
# of a PD cluster each spinning a thread per core oversubscribe it badly (test_models_oracle.py beside
# test_pd_cluster.py: 99 s and 112 s with a thread per core, 10 s and 30 s with one). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# name -> (family, overrides). Two layer patterns per family: attention early vs late, several recurrent in a row.
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
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


# The files that take longest on the 2-core CI box, longest first. scripts/test.sh runs xdist with --dist loadfile
# --no-loadscope-reorder: whole files go to whichever worker asks next, in collection order, and this order puts
# these first, so what is left at the end is short files that even out the two workers (otherwise xdist hands out
# files with the most tests first, and the heaviest files, of one to three tests, came last on one worker). Only
# an order: a file missing here runs after them, in the usual order. test_proxy_attacks.py (20-25 s) is left out on
# purpose: it bounds /health latency under attack (< 0.5 s), which a Ray start on the other worker can break.
HEAVY_FIRST = (
    "tests/integration/test_pd_faults.py",  # about 45-65 s each when run alone with a second process busy
    "tests/integration/test_cluster_routing.py",
    "tests/integration/test_pd_tensor_parallel.py",
    "tests/chaos/test_local_attacker.py",
    "tests/chaos/test_chaos.py",  # 30-40 s
    "tests/unit/test_tensor_parallel.py",
    "tests/integration/test_fail_closed.py",
    "tests/integration/test_prometheus_live.py",
    "tests/integration/test_serve_ray.py",
    "tests/integration/test_ray_multinode.py",
    "tests/integration/test_pd_cluster.py",  # 20-30 s
    "tests/unit/test_pd_differential.py",  # 25-40 s: four clusters
    "tests/unit/test_split_groups.py",
    "tests/unit/test_goodput.py",
    "tests/integration/test_kvtransfer.py",
    "tests/integration/test_structured_http.py",  # 12-20 s
    "tests/unit/test_poison.py",
    "tests/unit/test_zeroing_engine.py",
    "tests/unit/test_bad_input.py",
    "tests/unit/test_tp_handoff.py",
    "tests/unit/test_engine_oracle.py",
    "tests/unit/test_zero_blocks.py",
    "tests/integration/test_worker_ports.py",
)


@pytest.hookimpl(trylast=True)  # after pytest groups a file's tests by their module-scoped fixtures' parameters
def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keeps its order
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
