"""The fused TP block end (engine.parallel.fused_allreduce) on two GPUs: the kernel against NCCL's all-reduce and the
separate residual-norm kernel, bit for bit, eagerly and replayed in a CUDA graph many times over (the exchange
slots must empty themselves between uses), with -0.0 in the inputs (the empty mark); then whole engines at TP 2 in
bf16, fused against HYBRIDPD_TP_FUSED_ALLREDUCE=0: the same tokens and logprobs."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu


def _reference(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, zc: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist
    from hybridpd.engine.kernels.fused import rms_norm

    s = x.clone()
    dist.all_reduce(s)
    return rms_norm(s, w, 1e-5, zc, res)


def _inputs(rank: int, step: int, rows: int, hidden: int, dtype: torch.dtype, dev: torch.device) -> Any:
    g = torch.Generator(device=dev).manual_seed(1000 * step + rank)  # x differs per rank
    x = torch.randn(rows, hidden, generator=g, device=dev).to(dtype)
    x[:, ::7] = -0.0  # the empty mark must still sum right
    shared = torch.Generator(device=dev).manual_seed(step)  # the residual stream is the same on every rank
    res = torch.randn(rows, hidden, generator=shared, device=dev).to(dtype)
    return x, res


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from hybridpd.engine.parallel.fused_allreduce import FusedReduceNorm

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    failures: list[str] = []
    for dtype, hidden, zc in ((torch.bfloat16, 4096, False), (torch.float16, 1000, True)):
        sites, max_rows = 3, 64
        f = FusedReduceNorm(group, rank, world, dev, hidden, max_rows, sites, dtype)
        w = torch.randn(hidden, generator=torch.Generator(device=dev).manual_seed(7), device=dev).to(dtype)
        for step, rows in enumerate((1, 5, 64, 33, 64, 2) * 3):  # eager, sites in turn, rows changing
            f.begin()
            for site in range(sites):
                x, res = _inputs(rank, step * sites + site, rows, hidden, dtype, dev)
                got = f(x, w, 1e-5, zc, res)
                want = _reference(x, res, w, zc)
                if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                    failures.append(f"eager {dtype} rows {rows} site {site}")
        rows = 48  # the same in a graph, replayed with new inputs each time
        xs = [torch.zeros(rows, hidden, dtype=dtype, device=dev) for _ in range(sites)]
        res = torch.zeros(rows, hidden, dtype=dtype, device=dev)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            f.begin()
            h = res
            outs = []
            for site in range(sites):
                normed, h = f(xs[site], w, 1e-5, zc, h)
                outs.append(normed)
        for step in range(40):
            for site in range(sites):
                xs[site].copy_(_inputs(rank, 100 + step * sites + site, rows, hidden, dtype, dev)[0])
            res.copy_(_inputs(rank, 100 + step, rows, hidden, dtype, dev)[1])
            graph.replay()
            h = res
            for site in range(sites):
                normed, h = _reference(xs[site], h, w, zc)
                if not torch.equal(outs[site], normed):
                    failures.append(f"graph {dtype} step {step} site {site}")
        torch.cuda.synchronize()
        dist.barrier()
        del graph
    with open(f"{out}.{rank}", "w") as fh:
        fh.write("\n".join(failures[:20]) or "ok")
    dist.barrier()
    dist.destroy_process_group()


def _on_two_gpus(worker: Any, tmp_path: Any) -> list[str]:
    """Run worker(rank, 2, init, out) on two GPUs in two processes; each rank's report ("ok" or what failed)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from hybridpd.engine.parallel.group import free_port

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    out = str(tmp_path / "result")
    mp.spawn(worker, args=(2, f"tcp://127.0.0.1:{free_port()}", out), nprocs=2, join=True)
    return [open(f"{out}.{rank}").read() for rank in range(2)]


def test_fused_block_end_matches_nccl_and_norm(tmp_path):  # type: ignore[no-untyped-def]
    assert _on_two_gpus(_worker, tmp_path) == ["ok", "ok"]


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_last"])
def test_tp2_engine_fused_equals_nccl(name, checkpoint_dir, monkeypatch):  # type: ignore[no-untyped-def]
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from hybridpd.engine import LLM, SamplingParams

    from tests.oracle import random_prompts

    prompts = random_prompts([3, 17, 40, 64, 9, 120, 31, 2], vocab=256, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, top_logprobs=2)
    results = []
    for fused in ("1", "0"):
        monkeypatch.setenv("HYBRIDPD_TP_FUSED_ALLREDUCE", fused)
        llm = LLM(model=checkpoint_dir(name), tensor_parallel_size=2, device="cuda", dtype="bfloat16",
                  kv_cache_memory_bytes=256 * 2**20, max_model_len=512, max_num_batched_tokens=256)
        try:
            assert llm.engine.runner.graphs is not None
            assert (llm.engine.tp.block_reduce.fused is not None) == (fused == "1")
            results.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        finally:
            llm.shutdown()
    with_fused, with_nccl = results
    for a, b in zip(with_fused, with_nccl, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs


def _one_rank_cannot_allocate(rank: int, world: int, init: str, out: str) -> None:
    import datetime
    import time

    import torch.distributed as dist
    from hybridpd.engine.parallel import fused_allreduce as fa
    from hybridpd.engine.parallel.group import TPGroup

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=60)  # a rank left alone in a collective fails the test in a minute
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, timeout=timeout)
    tp = TPGroup(rank, world, dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout))
    if rank == 1:  # this GPU alone out of memory for the exchange buffer
        def refuse(self: Any, numel: int, device: torch.device) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory (rank 1 only)")

        fa.FusedReduceNorm._allocate = refuse  # type: ignore[method-assign]
    model = type("M", (), {"block_ends": 3, "hidden_size": 256})()
    t0 = time.monotonic()
    got = fa.build(tp, model, dev, torch.bfloat16, 16)
    s = torch.ones(4, device=dev)
    dist.all_reduce(s)  # the group still works: every rank left build at the same collective
    ok = got == 0 and tp.block_reduce.fused is None and bool((s == world).all()) and time.monotonic() - t0 < 30
    with open(f"{out}.{rank}", "w") as fh:
        fh.write("ok" if ok else f"build {got}, fused {tp.block_reduce.fused}, sum {s.tolist()}")
    dist.destroy_process_group()


def test_one_rank_failing_its_buffer_falls_back_on_every_rank(tmp_path):  # type: ignore[no-untyped-def]
    """One rank cannot allocate its exchange buffer: both keep NCCL at once (no rank waits alone in the
    rendezvous)."""
    assert _on_two_gpus(_one_rank_cannot_allocate, tmp_path) == ["ok", "ok"]
