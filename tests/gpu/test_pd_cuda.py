"""PD on CUDA over real processes, gRPC and NIXL (cuda_ipc between the workers' VRAM): greedy tokens identical to
the colocated engine on the same GPU, fp32 logprobs within 1e-4, and every prompt token transferred (P computes the
whole prompt and samples the first token).
This is the path decode workers take on GPUs: no NIXL progress thread in D, pulls polled by the step loop.
With two GPUs, P runs on cuda:0 and D on cuda:1 (NVLink); with one, both share it. Both workers run synchronously
and with asynchronous scheduling (--async-scheduling: the mode to be checked here before it can be on by default)."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine import LLM, SamplingParams

from tests.integration.cluster import complete, start_cluster
from tests.oracle import random_prompts

pytestmark = pytest.mark.gpu

LENGTHS = [2, 17, 40, 129, 300, 480]
NEW = 16


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_last"])
def test_pd_on_cuda_matches_colocated(name: str, asynchronous: bool, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    model = checkpoint_dir(name)
    two = torch.cuda.device_count() >= 2
    common = [
        "--device",
        "cuda:0",
        "--dtype",
        "float32",
        "--checkpoint-interval",
        "32",
        "--kv-cache-memory-bytes",
        str(256 * 2**20),
        *(["--async-scheduling"] if asynchronous else []),
    ]
    decode_env = {"CUDA_VISIBLE_DEVICES": "1"} if two else None
    cluster = start_cluster(model, worker_args=common, prefill_env={"CUDA_VISIBLE_DEVICES": "0"}, decode_env=decode_env)
    try:
        prompts = random_prompts(LENGTHS, vocab=256, seed=11)
        llm = LLM(
            model=model, device="cuda:0", dtype="float32", checkpoint_interval=32, kv_cache_memory_bytes=256 * 2**20
        )
        local = llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        )
        for p, lo in zip(prompts, local, strict=True):
            body = complete(cluster, p, NEW)
            choice = body["choices"][0]
            assert choice["token_ids"] == lo.token_ids, f"{len(p)}-token prompt: PD output differs"
            got = choice["logprobs"]["token_logprobs"]
            assert max(abs(a - b) for a, b in zip(got, lo.logprobs, strict=True)) < 1e-4
            assert body["usage"]["hybridpd"]["transferred_tokens"] == len(p)  # the whole prompt, computed by P
    finally:
        cluster.stop()
