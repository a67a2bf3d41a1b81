"""The P/D handoff fails closed, driven in one process without NIXL: the real PrefillServicer and DecodeServicer over
two EngineCores of the same tiny model, a fake pull that copies pages between their cache tensors, and D's Commit
answered by P's servicer directly.

Every scenario's tokens are compared with the colocated engine's (itself checked against transformers in
test_engine_oracle.py). Faults: P's lease expires and its pages are reused while D reads them (D frozen past the lease),
params of another prompt (with its own digest, and with a digest forged to match), a lease already expired by D's
clock, P unreachable at Commit, and a failing engine step on P. None may yield wrong tokens or poison D's cache.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.core import EngineCore
from hybridpd.kvtransfer.binding import prompt_digest
from hybridpd.kvtransfer.pull import PullState
from hybridpd.proto import hybridpd_pb2 as pb

from tests.oracle import random_prompts
from tests.support.pd_pair import COLOCATED_FIRST, Aborted, FakeContext, FakeHandle, Pair, make_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 6
MODEL = "nemotron_attn_mid"


def _sp() -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


async def prefill_response(pair: Pair, rid: str, prompt: list[int],
                           sp: pb.SamplingParams | None = None) -> pb.PrefillResponse:
    req = pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp or _sp())
    return await pair.p.Prefill(req, FakeContext())  # type: ignore[arg-type]


async def prefill(pair: Pair, rid: str, prompt: list[int]) -> pb.TransferParams:
    """P's transfer params for `prompt` (its first token is the colocated engine's: `generate` is given that)."""
    return (await prefill_response(pair, rid, prompt)).params


async def generate(pair: Pair, rid: str, prompt: list[int], params: pb.TransferParams | None,
                   first: int | None = None, sp: pb.SamplingParams | None = None) -> list[int]:
    """The request's output tokens: `first` (the proxy streamed it; with params, the colocated engine's first token
    of `prompt` unless given), then what D streams."""
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp or _sp())
    if params is not None:
        req.params.CopyFrom(params)
        if first is None:
            first = COLOCATED_FIRST[tuple(prompt)]
    toks: list[int] = []
    if first is not None:
        req.first_token.token_id = first
        toks.append(first)
    async for chunk in pair.d.Generate(req, FakeContext()):  # type: ignore[arg-type]
        toks += list(chunk.token_ids)
    return toks



async def settle(pair: Pair) -> None:
    """Both engines idle, every pool consistent, nothing pinned on P."""
    def check(core: EngineCore) -> None:
        assert not core.has_unfinished()
        core.cache.check_integrity()

    await pair.p.ctx.aengine.acall(check)
    await pair.d.ctx.aengine.acall(check)
    assert len(pair.p.leases) == 0 and not pair.p.held and not pair.d.consumer.pending


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([70, 70, 90], vocab=256, seed=5)


@pytest.fixture(scope="module")
def expected(checkpoint_dir, prompts):  # type: ignore[no-untyped-def]
    llm = LLM(model=checkpoint_dir(MODEL), checkpoint_interval=32, kv_cache_memory_bytes=8 * 2**20)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    COLOCATED_FIRST.update({tuple(p): o.token_ids[0] for p, o in zip(prompts, outs, strict=True)})
    return [o.token_ids for o in outs]


def test_handoff_commits_and_matches_colocated(checkpoint_dir, monkeypatch, prompts, expected):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            resp = await prefill_response(pair, "a", prompts[0])
            tp = resp.params
            assert tp.lease_token and tp.prompt_digest == prompt_digest(prompts[0], len(prompts[0]))
            assert list(resp.first.token_ids) == expected[0][:1] and not resp.first.finish_reason
            assert await generate(pair, "a", prompts[0], tp, resp.first.token_ids[0]) == expected[0]
            assert pair.d.consumer.num_recomputed == 0 and len(pair.pulls) == 1
            await settle(pair)  # Commit ended P's lease
        finally:
            pair.close()

    asyncio.run(run())


def test_lease_lost_during_the_read_means_recompute_and_no_poisoned_cache(checkpoint_dir, monkeypatch, prompts,
                                                                          expected):  # type: ignore[no-untyped-def]
    """D is slow past P's lease; P reaps it and reuses the pages for other requests
    while D's READ is still copying them. D must not use (or cache) what it read."""
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            tp = await prefill(pair, "a", prompts[0])

            def expire_and_reuse() -> None:
                def on_p(core: EngineCore) -> None:
                    for lease in pair.p.leases.reap(now=time.time() + 3600):
                        pair.p._free(lease.request_id)
                    for t in (t for ts in core.runner.group_tensors.values() for t in ts):
                        t.fill_(1e30)  # the freed pages now hold other requests' data
                pair.p.ctx.aengine.call(on_p).result(timeout=30)

            pair.during_read = expire_and_reuse
            assert await generate(pair, "a", prompts[0], tp) == expected[0]
            assert pair.d.consumer.num_refused == {"lease_lost": 1} and pair.d.consumer.num_recomputed == 1
            pair.during_read = None
            # D's prefix cache holds the recomputed prompt, not the garbage: a colocated repeat hits it
            assert await generate(pair, "a2", prompts[0], None) == expected[0]
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_foreign_params_are_refused_before_the_pull_and_at_commit(checkpoint_dir, monkeypatch, prompts,
                                                                   expected):  # type: ignore[no-untyped-def]
    """Cache poisoning through forged params: Generate(prompt A, params of prompt B)."""
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            a, b = prompts[0], prompts[1]
            tp_b = await prefill(pair, "b", b)
            assert await generate(pair, "x1", a, tp_b) == expected[0]  # B's digest: refused before any pull
            assert pair.d.consumer.num_refused == {"prompt_mismatch": 1} and not pair.pulls
            pair.p.ctx.aengine.call(lambda c: pair.p._release("b")).result()

            tp_b = await prefill(pair, "b2", b)
            forged = pb.TransferParams()
            forged.CopyFrom(tp_b)
            forged.prompt_digest = prompt_digest(a, len(a))  # a forger also rewrites the digest
            assert await generate(pair, "b2", a, forged) == expected[0]
            assert len(pair.pulls) == 1  # D pulled B's pages, and P's Commit refused them for prompt A
            assert pair.d.consumer.num_refused == {"prompt_mismatch": 1, "lease_lost": 1}
            assert await generate(pair, "a-again", a, None) == expected[0]  # nothing of B cached under A
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_expired_lease_and_unreachable_commit(checkpoint_dir, monkeypatch, prompts, expected):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch, lease_seconds=0.5)
        try:
            tp = await prefill(pair, "a", prompts[0])
            await asyncio.sleep(0.6)
            assert await generate(pair, "a", prompts[0], tp) == expected[0]  # D's clock: no time left to pull
            assert pair.d.consumer.num_refused == {"lease_expired": 1} and not pair.pulls

            pair.p.leases.ttl_s = 30.0
            tp = await prefill(pair, "c", prompts[2])
            pair.p_down = True  # P cannot confirm: D must not trust the bytes it read
            assert await generate(pair, "c", prompts[2], tp) == expected[2]
            assert pair.d.consumer.num_refused == {"lease_expired": 1, "lease_lost": 1}
            pair.p.ctx.aengine.call(lambda c: pair.p._release("c")).result()
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_a_failing_step_on_p_fails_the_prefill_at_once_and_leaks_nothing(checkpoint_dir, monkeypatch,
                                                                         prompts):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            def boom(*a: Any, **kw: Any) -> Any:
                raise RuntimeError("injected device fault")

            monkeypatch.setattr(pair.p_core.runner, "execute", boom)
            t0 = time.monotonic()
            with pytest.raises(Aborted) as e:
                await asyncio.wait_for(prefill(pair, "a", prompts[0]), timeout=5)
            assert time.monotonic() - t0 < 1.0 and "injected device fault" in str(e.value)
            usage = await pair.p.ctx.aengine.acall(lambda c: [s["in_use"] for s in c.cache.pool_stats()])
            assert usage == [0] * len(usage)
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_pinned_pages_are_capped_and_refused_with_resource_exhausted(checkpoint_dir, monkeypatch,
                                                                     prompts):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            total = await pair.p.ctx.aengine.acall(
                lambda c: next(int(s["total"]) for s in c.cache.pool_stats() if s["kind"] == "attention"))
            pair.p.max_pinned_fraction = 7 / total  # room for one 70-token prompt's 5 blocks, not for two
            await prefill(pair, "a", prompts[0])
            with pytest.raises(Aborted) as e:
                await prefill(pair, "b", prompts[1])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            pair.p.ctx.aengine.call(lambda c: pair.p._release("a")).result()
            await prefill(pair, "b", prompts[1])  # room again
            pair.p.ctx.aengine.call(lambda c: pair.p._release("b")).result()
            await settle(pair)
            assert not pair.p._reserved
        finally:
            pair.close()

    asyncio.run(run())


def test_abort_ends_the_generate_stream_while_running_and_while_pulling(checkpoint_dir, monkeypatch,
                                                                       prompts):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            long = pb.SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
            req = pb.GenerateRequest(request_id="run", prompt_token_ids=prompts[0], sampling_params=long)

            async def consume(r: pb.GenerateRequest) -> list[pb.GenerateChunk]:
                return [c async for c in pair.d.Generate(r, FakeContext())]  # type: ignore[arg-type]

            task = asyncio.create_task(consume(req))
            while not await pair.d.ctx.aengine.acall(lambda c: "run" in c.scheduler.requests):
                await asyncio.sleep(0.01)
            resp = await pair.d.Abort(pb.AbortRequest(request_id="run"), FakeContext())  # type: ignore[arg-type]
            chunks = await asyncio.wait_for(task, timeout=5)
            assert resp.aborted and chunks[-1].finish_reason == "abort"

            # aborted while its pull is in flight: the READ never completes here
            tp = await prefill(pair, "p", prompts[1])
            monkeypatch.setattr(FakeHandle, "poll", lambda self: PullState.PENDING)
            req = pb.GenerateRequest(request_id="p", prompt_token_ids=prompts[1], sampling_params=_sp(), params=tp,
                                     first_token=pb.FirstToken(token_id=1))
            task = asyncio.create_task(consume(req))
            while "p" not in pair.d.consumer.pending:
                await asyncio.sleep(0.01)
            resp = await pair.d.Abort(pb.AbortRequest(request_id="p"), FakeContext())  # type: ignore[arg-type]
            chunks = await asyncio.wait_for(task, timeout=5)
            assert resp.aborted and chunks[-1].finish_reason == "abort"
            assert not (await pair.d.Abort(pb.AbortRequest(request_id="p"), FakeContext())).aborted  # type: ignore[arg-type]
            pair.p.ctx.aengine.call(lambda c: pair.p._release("p")).result()
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_generate_chunks_carry_top_logprobs(checkpoint_dir, monkeypatch, prompts):  # type: ignore[no-untyped-def]
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            sp = pb.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
            req = pb.GenerateRequest(request_id="t", prompt_token_ids=prompts[0], sampling_params=sp)
            chunks = [c async for c in pair.d.Generate(req, FakeContext())]  # type: ignore[arg-type]
            toks = [t for c in chunks for t in c.token_ids]
            lps = [lp for c in chunks for lp in c.logprobs]
            tops = [top for c in chunks for top in c.top_logprobs]
            assert len(toks) == len(lps) == len(tops) == NEW
            for tok, lp, top in zip(toks, lps, tops, strict=True):
                assert len(top.token_ids) == 3 and list(top.logprobs) == sorted(top.logprobs, reverse=True)
                assert top.token_ids[0] == tok and abs(top.logprobs[0] - lp) < 1e-5  # greedy: the best is chosen
        finally:
            pair.close()

    asyncio.run(run())


def test_prefill_validates_the_prompt_once_in_one_step_thread_round_trip(checkpoint_dir, monkeypatch,
                                                                         prompts):  # type: ignore[no-untyped-def]
    """P validates a prompt once, in the call that adds it (one step-thread round trip); a bad prompt is
    INVALID_ARGUMENT and leaves no waiter, reservation or request behind."""
    async def run() -> None:
        pair = await make_pair(checkpoint_dir(MODEL), monkeypatch)
        try:
            seen: list[int] = []
            calls: list[int] = []
            validate, acall = pair.p_core.validate_prompt, pair.p.ctx.aengine.acall
            monkeypatch.setattr(pair.p_core, "validate_prompt", lambda p: (seen.append(len(p)), validate(p))[1])

            async def counting_acall(fn: Any) -> Any:
                calls.append(1)
                return await acall(fn)

            monkeypatch.setattr(pair.p.ctx.aengine, "acall", counting_acall)
            params = await prefill(pair, "a", prompts[0])
            assert seen == [len(prompts[0])] and len(calls) == 1 and params.num_computed_tokens == len(prompts[0])
            with pytest.raises(Aborted) as e:
                await prefill(pair, "bad", [1, 2, 10**9])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "bad" not in pair.p._waiters and "bad" not in pair.p._reserved
            monkeypatch.setattr(pair.p.ctx.aengine, "acall", acall)
            pair.p.ctx.aengine.call(lambda c: pair.p._release("a")).result()
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())
