"""Non-blocking copies through pinned memory on the GPU, each with the stream held back by a long kernel so that a
copy nobody waits for is still pending when the host reads or rewrites its pinned memory: the sampler's results
(SampledRows) are read only after their device-to-host copies, and the CUDA graphs' pinned input mirrors are refilled
only after the previous step's host-to-device copies. Both on cuda:0 and, with two GPUs, on cuda:1 while cuda:0 is
current (the copies and their event on the engine device's stream, not the current device's). With two GPUs, an
engine on cuda:1 stepped from a thread where cuda:0 is current, next to an engine on cuda:0 in the same process,
gives cuda:0's tokens (its Triton kernels and CUDA-graph captures on its own device)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.models.batch import GroupViews
from hybridpd.engine.models.cuda_graphs import DecodeGraphs
from hybridpd.engine.models.varlen import build_varlen_views
from hybridpd.engine.sampler import Sampler

from tests.oracle import random_prompts
from tests.unit.test_graph_inputs import BS, _split_seq

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 400_000_000
"""A kernel of about 0.2 s on an H100: what is queued behind it is pending while the host goes on."""
DEVICES = ["cuda:0", "cuda:1"]


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.index is not None and device.index >= torch.cuda.device_count():
        pytest.skip(f"needs {device.index + 1} GPUs")
    torch.cuda.set_device(0)  # on cuda:1: another device is current
    return device


def _hold_back(device: torch.device) -> None:
    with torch.cuda.device(device):
        torch.cuda._sleep(SLEEP_CYCLES)


@pytest.mark.parametrize("name", DEVICES)
def test_sampled_rows_are_read_after_their_copies(name: str) -> None:
    device = _device(name)
    rids = [f"r{i}" for i in range(6)]
    params = [SamplingParams(temperature=0.0, top_logprobs=3 * (i % 2)) for i in range(6)]
    for step in range(3):  # other logits each time: pinned memory reused from the step before holds other values
        logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(step)) * 4
        want = Sampler(torch.device("cpu")).sample_rows(logits, rids, params).resolve()
        on_device = logits.to(device)
        _hold_back(device)
        tokens, logprobs, top = Sampler(device).sample_rows(on_device, rids, params).resolve()
        assert tokens == want[0], f"step {step}: tokens read before their copy was done"
        assert max(abs(a - b) for a, b in zip(logprobs, want[1], strict=True)) < 1e-5
        assert top.keys() == want[2].keys()
        for rid, alternatives in top.items():
            assert [t for t, _ in alternatives] == [t for t, _ in want[2][rid]]
            assert max(abs(a - b) for (_, a), (_, b) in zip(alternatives, want[2][rid], strict=True)) < 1e-5


@pytest.mark.parametrize("name", DEVICES)
def test_graph_mirrors_are_refilled_after_the_previous_copies(name: str) -> None:
    device = _device(name)
    views = GroupViews(layer_views=(0, 0, 1, 1), attention=(True, True), recurrent=(True, True))
    graphs = DecodeGraphs(None, None, 16, 40, BS, 4, device, views)
    steps = [
        [_split_seq(f"r{i}", c + k, 1 + 40 * i, 1 + i) for i, c in enumerate([40, 17, 300, 5, 64])] for k in range(2)
    ]
    b = graphs.bucket(5)
    assert b is not None
    _hold_back(device)
    graphs._upload(steps[0], b)  # its copies wait behind the kernel ...
    first = [t[:b].clone() for t in (graphs.ids, graphs.positions, graphs.ctx_len, graphs.has_init)]
    first += [t[:b].clone() for v in graphs.inputs for t in (v.slot_mapping, v.slots)]
    graphs._upload(steps[1], b)  # ... while the host fills the next step's mirrors, unless it waits for them
    torch.cuda.synchronize(device)
    metas = build_varlen_views(steps[0], BS, 4, torch.device("cpu"), views, pad_to=b)
    want = [metas[0].input_ids, metas[0].positions, metas[0].ctx_len, metas[0].rec_decode.has_init]  # type: ignore[union-attr]
    want += [t for m in metas for t in (m.slot_mapping, m.rec_decode.slots)]  # type: ignore[union-attr]
    for got, expected in zip(first, want, strict=True):
        assert torch.equal(got.cpu(), expected.to(got.dtype)), "a step's copies read the next step's inputs"


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    """`llm.generate` on a new thread: cuda:0 is its current device, whatever the caller's is."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(llm.generate(prompt_token_ids=prompts, sampling_params=params)))
    thread.start()
    thread.join()
    assert box, "generate failed on its thread (see the log)"
    return box[0]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_engine_on_cuda1_stepped_where_cuda0_is_current(asynchronous: bool, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = checkpoint_dir("nemotron_attn_mid")
    settings: dict[str, Any] = {"dtype": "float32", "kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 512}
    prompts = random_prompts([3, 40, 130, 17], vocab=256, seed=5)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, top_logprobs=2 * (i % 2))
        for i in range(len(prompts))
    ]
    engines = [LLM(model=path, device=d, async_scheduling=asynchronous, **settings) for d in ("cuda:0", "cuda:1")]
    try:
        torch.cuda.set_device(0)
        results = [_generate(llm, prompts, params) for llm in engines]  # cuda:0 captures the process's first graphs
        for llm in engines:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
        for a, b in zip(*results, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
            assert [[t for t, _ in top] for top in a.top_logprobs or []] == [
                [t for t, _ in top] for top in b.top_logprobs or []
            ]
    finally:
        for llm in engines:
            llm.shutdown()
