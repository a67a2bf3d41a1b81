"""Tensor parallelism on CPU (gloo ranks): TP 2 and TP 4 give the same greedy tokens as TP 1 in fp32.

The models are chosen so that every splitting rule runs: a single KV head (replicated on every rank), a Mamba
group count below the TP size (B/C replicated, the gated norm's groups spanning ranks), a Mamba group count the TP
size divides (B/C split), Gated-DeltaNet key heads split, MoE experts cut inside (or, with expert parallelism,
whole experts per rank), an MLP, a vocabulary split.
Prompts are chunked (small token budget, prefill mixed with decode), and a second round reuses the first round's
prefixes (cached blocks and recurrent checkpoints restored: state copies broadcast to every rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.parallel.experts import LocalRouter
from hybridpd.engine.parallel.layers import ParallelLMHead

from tests.oracle import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # 2 query heads, 1 KV head; n_groups 1 < TP 2; MoE (4 experts, top 2) with a shared expert; an MLP; odd
    # expert and MLP widths (the first rank holds one channel more)
    "nemotron_moe_kv1_g1": (
        "nemotron_h",
        {
            "hybrid_override_pattern": "M*E-M",
            "num_key_value_heads": 1,
            "n_groups": 1,
            "moe_intermediate_size": 33,
            "intermediate_size": 91,
        },
    ),
    # 2 query heads, 1 KV head (gated attention), 2 GDN key heads / 4 value heads split; an odd MLP width
    "qwen": (
        "qwen3_5",
        {"layer_types": ["linear_attention", "full_attention", "linear_attention"], "intermediate_size": 45},
    ),
    # TP 4: 4 query heads, 2 KV heads (replicated twice), n_groups 2 < 4, 8 Mamba heads, MoE; expert widths 62
    # (15 or 16 a rank) and 48 (runs of 8: 16, 16, 8, 8)
    "nemotron_tp4": (
        "nemotron_h",
        {
            "hybrid_override_pattern": "M*EM-",
            "num_attention_heads": 4,
            "head_dim": 16,
            "moe_intermediate_size": 62,
            "moe_shared_expert_intermediate_size": 48,
        },
    ),
    # no attention layer at all: the cache holds recurrent states only
    "nemotron_states_only": ("nemotron_h", {"hybrid_override_pattern": "M-ME"}),
    # 3 KV heads: neither split over nor replicated on 2 ranks
    "nemotron_kv3": (
        "nemotron_h",
        {"hybrid_override_pattern": "*M", "num_attention_heads": 6, "head_dim": 16, "num_key_value_heads": 3},
    ),
}
LENGTHS = [3, 40, 70]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SETTINGS: dict[str, Any] = {"max_num_batched_tokens": 48, "kv_cache_memory_bytes": 16 * 2**20, "max_model_len": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            family, overrides = MODELS[name]
            made[name] = write_random_checkpoint(str(tmp_path_factory.mktemp(name)), family, seed=0, **overrides)
        return made[name]

    return get


def _rounds(llm: LLM, score_prompt: bool = False) -> list[tuple[list[int], list[float]]]:
    prompts = random_prompts(LENGTHS, 500, seed=3)
    first = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    again = [prompts[-1] + [7, 8, 9]]  # a prefix hit: cached blocks and state checkpoints
    second = llm.generate(prompt_token_ids=again, sampling_params=GREEDY)
    if not score_prompt:
        return [(o.token_ids, o.logprobs) for o in first + second]
    # prompt logprobs: every rank computes the scored rows' logits (the LM head gathers them), over two chunks
    (scored,) = llm.generate(
        prompt_token_ids=prompts[-1:], sampling_params=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    )
    assert scored.prompt_logprobs is not None
    prompt = (
        [t for row in scored.prompt_logprobs[1:] for t in row],
        [lp.logprob for row in scored.prompt_logprobs[1:] for lp in row.values()],
    )
    return [(o.token_ids, o.logprobs) for o in first + second] + [prompt]


def _run(
    path: str, tp: int, score_prompt: bool = False, **extra: Any
) -> tuple[list[tuple[list[int], list[float]]], dict[str, int]]:
    llm = LLM(model=path, tensor_parallel_size=tp, **SETTINGS, **extra)
    try:
        if tp > 1:
            model: Any = llm.engine.model
            assert isinstance(model.lm_head, ParallelLMHead) and model.tp_size == tp
        if extra.get("enable_expert_parallel"):  # rank 0 keeps its whole experts and the no-expert slot
            moe = next(ly.mixer for ly in llm.engine.model.backbone.layers if hasattr(ly.mixer, "experts"))
            assert len(moe.experts) == 4 // tp + 1 and isinstance(moe.gate, LocalRouter)
        out = _rounds(llm, score_prompt)
        llm.engine.cache.check_integrity()
        return out, llm.kv_cache_info()
    finally:
        procs = list(llm.engine.followers.procs) if tp > 1 else []
        llm.shutdown()
        _assert_left_together(procs)


def _assert_left_together(procs: list[Any]) -> None:
    """After a shutdown every rank left the group (NCCL's teardown needs them all) and exited cleanly."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert [p.wait(timeout=60) for p in procs] == [0] * len(procs)


def assert_same(tp1, tpn) -> None:  # type: ignore[no-untyped-def]
    for i, ((toks1, lps1), (toksn, lpsn)) in enumerate(zip(tp1, tpn, strict=True)):
        assert toksn == toks1, f"request {i}: greedy tokens differ"
        assert max(abs(a - b) for a, b in zip(lps1, lpsn, strict=True)) < 1e-4, f"request {i}: logprobs differ"


@pytest.mark.parametrize(
    ("name", "tp", "ep"),
    [
        ("nemotron_moe_kv1_g1", 2, False),
        ("nemotron_moe_kv1_g1", 2, True),
        ("qwen", 2, False),
        ("nemotron_tp4", 4, False),
        ("nemotron_states_only", 2, False),
    ],
)
def test_tp_matches_tp1(name, tp, ep, model_dir):  # type: ignore[no-untyped-def]
    """ep: expert parallelism for the MoE blocks (whole experts per rank) instead of TP inside the experts."""
    path = model_dir(name)
    ref, info1 = _run(path, 1, score_prompt=name == "qwen")  # one model also scores a prompt (prompt logprobs)
    got, info_n = _run(path, tp, score_prompt=name == "qwen", enable_expert_parallel=ep)
    assert_same(ref, got)
    # each rank holds its slice of every recurrent state (and of every page, unless KV heads are replicated)
    assert info_n["bytes_per_state"] < info1["bytes_per_state"]
    assert info_n["bytes_per_token"] <= info1["bytes_per_token"]


def test_tp2_async_scheduling_matches_tp1(model_dir):  # type: ignore[no-untyped-def]
    """Asynchronous scheduling at TP 2: every rank's step N+1 reads rank 0's samples of step N on the device (a
    broadcast at the end of each launch); requests that end at a stop token leave overrun rows. Same tokens as the
    synchronous TP 1 engine."""
    path = model_dir("nemotron_moe_kv1_g1")
    prompts = random_prompts(LENGTHS, 500, seed=3)
    ref_llm = LLM(model=path, **SETTINGS)
    probes = ref_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(p.token_ids[2 + i],))
        for i, p in enumerate(probes)
    ]
    ref = [(o.token_ids, o.logprobs) for o in ref_llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(model=path, tensor_parallel_size=2, async_scheduling=True, **SETTINGS)
    try:
        got = [(o.token_ids, o.logprobs) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        pipeline = llm.engine.pipeline
        assert pipeline.num_ahead > 0 and pipeline.num_overrun > 0, vars(pipeline)
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()
    assert_same(ref, got)


def test_unsplittable_model_is_refused_before_any_rank_starts(model_dir):  # type: ignore[no-untyped-def]
    """A head count TP cannot cut: a clear error naming the config field, no follower spawned, and the process can
    start another engine afterwards (no process group left behind)."""
    import torch.distributed as dist
    from hybridpd.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="num_key_value_heads=3"):
        LLM(model=model_dir("nemotron_kv3"), tensor_parallel_size=2, **SETTINGS)
    assert not dist.is_initialized()
    llm = LLM(model=model_dir("nemotron_kv3"), **SETTINGS)
    try:
        assert len(llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)[0].token_ids) == 6
    finally:
        llm.shutdown()


def test_generate_cli_tp2_matches_tp1(model_dir):  # type: ignore[no-untyped-def]
    path = model_dir("nemotron_moe_kv1_g1")
    prompts = ["Hello, hybrid world", "tensor parallel"]
    llm = LLM(model=path, **SETTINGS)
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))]
    argv = [
        sys.executable,
        "-m",
        "hybridpd.deploy.cli",
        "generate",
        "--model",
        path,
        "--tensor-parallel-size",
        "2",
        "--max-tokens",
        "8",
        "--kv-cache-memory-bytes",
        str(SETTINGS["kv_cache_memory_bytes"]),
    ]
    for p in prompts:
        argv += ["--prompt", p]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    got = [json.loads(line)["token_ids"] for line in run.stdout.splitlines() if line.startswith("{")]
    assert got == want, f"stdout: {run.stdout[-1500:]}\nstderr: {run.stderr[-2500:]}"


FAULT_SCRIPT = """
import json, os, signal, sys, threading, time
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.parallel import executor
executor.FROZEN_RANK_S = 0.5
path, sig = sys.argv[1], getattr(signal, sys.argv[2])
llm = LLM(model=path, tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
core, steps = llm.engine, [0]
reqs = [core.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        for i in range(2)]

def hit() -> None:  # a few steps in, while rank 0 may be inside a step's collectives
    while steps[0] < 2:
        time.sleep(0.001)
    os.kill(core.followers.procs[0].pid, sig)

threading.Thread(target=hit, daemon=True).start()
while core.has_unfinished():
    try:
        core.step()
    except Exception as e:  # as the serving loop (engine.async_engine): the step's requests end with an error
        core.fail_all(str(e))
    steps[0] += 1
    print("TOKENS", json.dumps([r.output_token_ids for r in reqs]), flush=True)
print("SURVIVED", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_frozen_rank_ends_the_worker_without_a_wrong_token(sig, model_dir):  # type: ignore[no-untyped-def]
    """A follower rank killed, or stopped (frozen), mid-decode: rank 0 kills what is left of its ranks and exits
    (code 70, restarted whole by its launcher); every token that came out before is TP 1's."""
    path = model_dir("qwen")
    ref = LLM(model=path, kv_cache_memory_bytes=16 << 20)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in ref.generate(prompt_token_ids=[[1, 2, 3], [2, 2, 3]], sampling_params=greedy)]
    run = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT, path, sig],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 70, run.stderr[-2000:]
    assert "SURVIVED" not in run.stdout and "restarted whole" in run.stderr
    assert sig == "SIGKILL" or "frozen" in run.stderr  # found by rank 0's watchdog, not a collective's timeout
    for line in run.stdout.splitlines():
        got = json.loads(line.removeprefix("TOKENS "))
        assert all(g == w[: len(g)] for g, w in zip(got, want, strict=True)), line
    assert not [p for p in _children_named("hybridpd.engine.parallel.executor")], "a follower outlived its worker"


def _children_named(module: str) -> list[int]:
    """Processes still running `python -m module` started by this test process's children (none after a fault)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if module.encode() in cmd and ppid == 1:  # orphaned (its rank 0 is gone)
            out.append(int(pid))
    return out


def test_a_failure_on_rank_0_alone_ends_the_worker(model_dir):  # type: ignore[no-untyped-def]
    """Rank 0 failing inside a step (after some of its collectives) leaves the followers in a collective it will
    not join: its next step would meet theirs (a hang on CPU, the wrong sums on GPU). The failure ends the worker
    (LeaderRunner's on_error: Followers.fail in production), never just the step's requests."""
    llm = LLM(model=model_dir("qwen"), tensor_parallel_size=2, **SETTINGS)
    core = llm.engine
    failed: list[BaseException] = []
    object.__setattr__(core.runner, "_on_error", failed.append)
    head, calls = core.model.lm_head, [0]
    forward = head.forward

    def flaky(hidden):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("rank 0 only")
        return forward(hidden)

    head.forward = flaky
    try:
        with pytest.raises(RuntimeError, match="rank 0 only"):
            llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)
        assert [str(e) for e in failed] == ["rank 0 only"]
    finally:
        core.followers.abort()  # the followers wait in the LM head's gather: killed, the group left
        llm.shutdown()
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_leaving_the_group_is_bounded(monkeypatch):  # type: ignore[no-untyped-def]
    """A rank that never leaves (NCCL's teardown then waits forever) costs a warning and an abort, not a hang."""
    import threading

    import torch.distributed as dist
    from hybridpd.engine.parallel import executor

    stuck, aborted = threading.Event(), []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: stuck.wait(30))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda *a, **k: aborted.append(1))
    try:
        assert executor.leave_group(timeout_s=0.2) is False and aborted == [1]
        monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
        assert executor.leave_group(timeout_s=5.0) is True and aborted == [1]
    finally:
        stuck.set()
