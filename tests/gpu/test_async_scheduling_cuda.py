"""Asynchronous scheduling on a GPU (fast path, CUDA graphs: fed input ids copied into the graph's buffer on the
device, samples read back through pinned memory and an event, the graphs' pinned mirrors guarded by an event,
rolling checkpoints copied one step late; at TP 2 the samples broadcast over NCCL): the synchronous engine's
tokens, bit-for-bit logprobs when no request ends at a step the engine could not know in advance, and the same
prefix hits in a second round. The CPU tests (tests/unit/test_async_scheduling.py) check the rest of the
invariants on the reference path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.request import RequestOutput

from tests.oracle import random_prompts

pytestmark = pytest.mark.gpu

SETTINGS: dict[str, Any] = {
    "device": "cuda",
    "dtype": "float32",
    "kv_cache_memory_bytes": 256 * 2**20,
    "max_model_len": 512,
    "max_num_batched_tokens": 256,
}
LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300, 15, 48, 90, 5]


def _run(llm: LLM, prompts: list[list[int]], stops: list[int] | None) -> list[RequestOutput]:
    if stops is None:
        params: Any = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    else:
        params = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(s,)) for s in stops]
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def _rounds(llm: LLM) -> list[list[RequestOutput]]:
    prompts = random_prompts(LENGTHS, vocab=256, seed=2)
    known = _run(llm, prompts, None)
    stops = [o.token_ids[3 + i % 30] for i, o in enumerate(known)]
    stopped = _run(llm, prompts, stops)
    again = [p + o.token_ids + [5, 6] for p, o in zip(prompts, stopped, strict=True)]
    return [known, stopped, _run(llm, again, stops)]


def _shutdown(llm: LLM) -> None:
    """Shut down cleanly: graphs destroyed before the group is left on every rank (NCCL waits forever for a live
    graph that captured its all-reduces), every rank left, the followers exited 0."""
    import time

    import torch.distributed as dist

    procs = list(llm.engine.followers.procs) if llm.engine.followers is not None else []
    t = time.perf_counter()
    llm.shutdown()
    assert time.perf_counter() - t < 20.0 and not dist.is_initialized()
    assert [p.wait(timeout=30) for p in procs] == [0] * len(procs)


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_last"])
@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_async_matches_sync(name, tp, checkpoint_dir):  # type: ignore[no-untyped-def]
    if tp > torch.cuda.device_count():
        pytest.skip(f"needs {tp} GPUs")
    path = checkpoint_dir(name)
    results = []
    for asynchronous in (False, True):
        llm = LLM(model=path, tensor_parallel_size=tp, async_scheduling=asynchronous, **SETTINGS)
        try:
            assert llm.engine.runner.fast_path and llm.engine.runner.graphs is not None
            results.append(_rounds(llm))
            if asynchronous:
                pipe = llm.engine.pipeline
                assert pipe.num_ahead > 50 and pipe.num_overrun > 0 and pipe.num_late_checkpoints > 0
            llm.engine.cache.check_integrity()
        finally:
            _shutdown(llm)
    sync, fast = results
    for a, b in zip(sync[0], fast[0], strict=True):  # every end known in advance: the same batches, bit for bit
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
    for run in (1, 2):  # ends at stop tokens: overrun rows (a graph bucket may change: rounding only)
        for a, b in zip(sync[run], fast[run], strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert a.num_cached_tokens == b.num_cached_tokens
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) < 1e-4
