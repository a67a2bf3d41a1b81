"""Asynchronous scheduling (`async_scheduling=True`) gives exactly the synchronous engine's results.

The engine launches decode step N+1 (its input tokens fed on the device from step N's samples) before it has read
step N's tokens, so a request that ends at step N (a stop token, a stop string, EOS) has run one step too many. The
tests check, on both hybrid families, that nothing observable differs from the synchronous engine: tokens, logprobs
(bit for bit), top logprobs, text, finish reasons, stop reasons, prefix hits of a second round (cached blocks and
recurrent checkpoints published from the first), what the prefix cache holds afterwards, pool integrity; and that
the run-ahead really happened, extra steps of ended requests included (else the comparison would prove nothing).
Penalties and min_tokens take step N's token from the device; a batch with a request that needs it on the host
(structured output) or with requests waiting to be admitted runs synchronously."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hybridpd.engine import LLM, SamplingParams
from hybridpd.engine.request import RequestOutput

from tests.oracle import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS: dict[str, Any] = {
    "kv_cache_memory_bytes": 16 * 2**20,
    "max_model_len": 256,
    "block_size": 16,
    "max_num_batched_tokens": 64,
}


def _engines(path: str, **extra: Any) -> tuple[LLM, LLM]:
    return LLM(model=path, **SETTINGS, **extra), LLM(model=path, async_scheduling=True, **SETTINGS, **extra)


def _params(i: int, probe: RequestOutput, vocab: int) -> SamplingParams:
    """Request i's parameters: it ends at a step the engine cannot know in advance (a stop id or string taken from
    its own greedy probe run), at a known step (max_tokens), or it forces synchronous steps."""
    toks, text = probe.token_ids, probe.text
    greedy: dict[str, Any] = {"temperature": 0.0}
    mix = [
        SamplingParams(max_tokens=24, stop_token_ids=(toks[6],), **greedy),
        SamplingParams(max_tokens=24, ignore_eos=True, **greedy),
        SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, top_k=20, seed=7, top_logprobs=3),
        SamplingParams(max_tokens=1, **greedy),
        SamplingParams(max_tokens=20, temperature=0.8, seed=11, stop_token_ids=(toks[2], toks[9])),
        SamplingParams(max_tokens=12, logit_bias={3: 1.5, vocab - 1: -2.0}, top_logprobs=2, **greedy),
        SamplingParams(max_tokens=15, stop_token_ids=(toks[4],), min_tokens=8, **greedy),
        SamplingParams(max_tokens=24, stop=(text[len(text) // 2 : len(text) // 2 + 2],), **greedy),
        SamplingParams(max_tokens=3, **greedy),
        SamplingParams(max_tokens=10, presence_penalty=0.5, stop_token_ids=(toks[7],), **greedy),
        SamplingParams(max_tokens=4, min_tokens=7, ignore_eos=True, **greedy),  # min_tokens outlasts max_tokens
        SamplingParams(max_tokens=24, stop_token_ids=(toks[11],), top_logprobs=1, **greedy),
    ]
    return mix[i % len(mix)]


def _same(a: list[RequestOutput], b: list[RequestOutput], bitwise: bool = True) -> None:
    """`bitwise` False: logprob values may differ in their last bits (an overrun row changed a step's batch shape,
    which moves float rounding as any other batch composition does); everything else must be equal."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        if bitwise:
            assert x.logprobs == y.logprobs
            assert x.top_logprobs == y.top_logprobs
        else:
            assert x.logprobs == pytest.approx(y.logprobs, rel=0, abs=1e-4)
            assert [[t for t, _ in top] for top in x.top_logprobs] == [[t for t, _ in top] for top in y.top_logprobs]
        assert (x.text, x.finish_reason, x.num_cached_tokens, x.num_preemptions) == (
            y.text,
            y.finish_reason,
            y.num_cached_tokens,
            y.num_preemptions,
        )


def _cache_state(llm: LLM) -> tuple[Any, ...]:
    core = llm.engine
    health = core.pool_health()
    assert all(h["integrity_ok"] for h in health)
    assert all(h["in_use"] == 0 for h in health), health  # every request's pages given back
    return tuple(sorted(map(sorted, core.cache.cached_hashes().values()))), core.stats.num_scheduled_tokens


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_last"])
def test_async_matches_sync(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    sync, fast = _engines(checkpoint_dir(name))
    # left unset, asynchronous scheduling is off on the CPU (on for CUDA: the host is not the device there)
    assert sync.engine.async_scheduling is False and sync.engine.pipeline is None
    assert fast.engine.async_scheduling is True and fast.engine.pipeline is not None
    vocab = sync.engine.vocab_size
    prompts = random_prompts([5, 19, 33, 8, 47, 12, 26, 3, 40, 21, 17, 30, 9], vocab, seed=3)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    probes = sync.generate(prompt_token_ids=prompts, sampling_params=greedy)
    fast.generate(prompt_token_ids=prompts, sampling_params=greedy)
    params = [_params(i, p, vocab) for i, p in enumerate(probes)]
    first = [
        sync.generate(prompt_token_ids=prompts, sampling_params=params),
        fast.generate(prompt_token_ids=prompts, sampling_params=params),
    ]
    _same(*first, bitwise=False)
    assert {o.finish_reason for o in first[0]} >= {"stop", "length"}
    # a second round continues every conversation: prefix hits on what the first round published
    again = [p + o.token_ids + [7, 8, 9] for p, o in zip(prompts, first[0], strict=True)]
    second = [llm.generate(prompt_token_ids=again, sampling_params=params) for llm in (sync, fast)]
    _same(*second, bitwise=False)
    assert any(o.num_cached_tokens > 0 for o in second[0])
    assert _cache_state(sync) == _cache_state(fast)
    pipeline = fast.engine.pipeline
    assert pipeline is not None and sync.engine.pipeline is None
    assert pipeline.num_ahead > 20  # steps launched before the previous step's tokens were read
    assert pipeline.num_overrun > 0  # rows of requests that had already ended: computed, never used
    assert pipeline.num_late_checkpoints > 0  # rolling checkpoints of rows that crossed a page boundary ahead
    assert pipeline.num_sync_fallbacks > 0  # admissions (chunked prompts waiting): synchronous steps


def test_async_penalties_run_ahead_bit_for_bit(checkpoint_dir):  # type: ignore[no-untyped-def]
    """Penalties count the token a step launched ahead has not read yet from the device (its row's sample): the
    same counts, so the same logits, bit for bit."""
    sync, fast = _engines(checkpoint_dir("nemotron_attn_mid"))
    prompts = random_prompts([6, 9, 14], sync.engine.vocab_size, seed=5)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.5, repetition_penalty=3.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.0, frequency_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, frequency_penalty=1.0, presence_penalty=1.0,
                       min_tokens=6, ignore_eos=True),
    ]
    outs = [llm.generate(prompt_token_ids=prompts, sampling_params=params) for llm in (sync, fast)]
    _same(*outs)
    assert fast.engine.pipeline.num_ahead > 5 and fast.engine.pipeline.num_overrun == 0
    plain = sync.generate(prompt_token_ids=prompts, sampling_params=[
        dataclasses.replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0) for p in params])
    assert any(a.token_ids != b.token_ids for a, b in zip(plain, outs[0], strict=True))  # the penalties bite


def test_async_bad_words_read_the_unread_token(checkpoint_dir):  # type: ignore[no-untyped-def]
    """A word of several tokens is banned after its prefix, the last token of which may be a step's unread sample
    (read from the device): the same outputs as synchronous, and no output holds a banned sequence."""
    sync, fast = _engines(checkpoint_dir("nemotron_attn_mid"))
    tok = sync.engine.tokenizer
    assert tok is not None
    prompts = random_prompts([6, 9, 14], sync.engine.vocab_size, seed=5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    probes = sync.generate(prompt_token_ids=prompts, sampling_params=greedy)
    kept = [(p, tok.decode(o.token_ids[3:5])) for p, o in zip(prompts, probes, strict=True)]
    kept = [(p, w) for p, w in kept if w.strip()]
    assert kept
    prompts, params = [p for p, _ in kept], [dataclasses.replace(greedy, bad_words=(w,)) for _, w in kept]
    outs = [llm.generate(prompt_token_ids=prompts, sampling_params=params) for llm in (sync, fast)]
    _same(*outs)
    assert fast.engine.pipeline.num_ahead > 5
    for p, o in zip(params, outs[0], strict=True):
        for seq in p.with_bad_words_token_ids(tok.encode).bad_words_token_ids:
            assert all(tuple(o.token_ids[j : j + len(seq)]) != seq for j in range(len(o.token_ids)))
    assert any(o.token_ids != probe.token_ids for o, probe in zip(outs[0], probes, strict=False))  # the ban bites


@pytest.mark.parametrize("name", ["nemotron_attn_mid", "qwen_attn_last"])
def test_async_bitwise_when_every_end_is_known(name, checkpoint_dir):  # type: ignore[no-untyped-def]
    """Ends known in advance (max_tokens) leave no overrun row: every step's batch is the synchronous one, and the
    results are equal bit for bit (seeded sampling, top logprobs and logit bias included)."""
    sync, fast = _engines(checkpoint_dir(name))
    vocab = sync.engine.vocab_size
    prompts = random_prompts([5, 19, 33, 8, 21, 12], vocab, seed=9)
    params = [
        SamplingParams(
            max_tokens=6 + 3 * i,
            ignore_eos=True,
            temperature=0.0 if i % 2 else 0.7,
            seed=i,
            top_logprobs=i % 3,
            logit_bias={i: 1.0},
        )
        for i in range(len(prompts))
    ]
    _same(*[llm.generate(prompt_token_ids=prompts, sampling_params=params) for llm in (sync, fast)])
    assert fast.engine.pipeline.num_ahead > 10 and fast.engine.pipeline.num_overrun == 0


def test_pages_of_a_step_in_flight_stay_held(checkpoint_dir):  # type: ignore[no-untyped-def]
    """Invariant 3: between steps, every page and running state slot that the step in flight computes into is held
    (referenced) by its pool, even for requests that have ended or were aborted, so no other request can be given
    it while that step writes it."""
    _, fast = _engines(checkpoint_dir("nemotron_attn_mid"))
    core = fast.engine
    prompts = random_prompts([7, 30, 12, 21], core.vocab_size, seed=2)
    probes = fast.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    for i, (p, probe) in enumerate(zip(prompts, probes, strict=True)):
        core.add_request(
            f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(probe.token_ids[3 + i],))
        )
    checked = aborted = 0
    while core.has_unfinished():
        core.step()
        f = core.pipeline.in_flight
        if f is None:
            continue
        if not aborted and "r1" in core.scheduler.requests and "r1" in f.requests:
            core.abort("r1")  # between steps, as a worker's call does
            aborted = 1
        for s in f.out.seqs:
            for _, blocks in s.group_block_ids:
                assert all(core.cache.pages.ref[b] > 0 for b in blocks)
            for _, slot in s.group_state_slots:
                assert core.cache.slots.held[slot]
            checked += s.request_id not in core.scheduler.requests
    assert aborted and checked > 0  # rows of ended requests were in flight, and their pages held
    assert all(h["in_use"] == 0 for h in core.pool_health())


def test_pd_decode_worker_with_async_scheduling_matches_colocated(checkpoint_dir, monkeypatch):  # type: ignore[no-untyped-def]
    """A decode worker with asynchronous scheduling continuing three handed-off requests at once (imported pages and
    states, the first token from P, output held until P confirms) gives the colocated engine's tokens; P's
    prefill-only steps stay synchronous."""
    import asyncio
    import dataclasses

    from hybridpd.proto import hybridpd_pb2 as pb

    from tests.support.pd_pair import FakeContext, make_pair

    path = checkpoint_dir("nemotron_attn_mid")
    colocated = LLM(model=path, **SETTINGS)
    prompts = random_prompts([40, 23, 57], colocated.engine.vocab_size, seed=4)
    probes = colocated.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    stops = [p.token_ids[4 + 2 * i] for i, p in enumerate(probes)]
    want = [
        o.token_ids
        for o in colocated.generate(
            prompt_token_ids=prompts,
            sampling_params=[SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(s,)) for s in stops],
        )
    ]

    def config(asynchronous: bool):  # type: ignore[no-untyped-def]
        from hybridpd.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

        return EngineConfig(
            model=ModelConfig(path=path, dtype="float32", device="cpu", max_model_len=256),
            cache=CacheConfig(block_size=16, kv_cache_memory_bytes=16 * 2**20),
            scheduler=dataclasses.replace(SchedulerConfig(max_num_batched_tokens=64), async_scheduling=asynchronous),
        )

    async def one(pair, i: int) -> list[int]:  # type: ignore[no-untyped-def]
        sp = pb.SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stops[i]])
        pre = await pair.p.Prefill(
            pb.PrefillRequest(request_id=f"q{i}", prompt_token_ids=prompts[i], sampling_params=sp), FakeContext()
        )
        gen = pb.GenerateRequest(request_id=f"q{i}", prompt_token_ids=prompts[i], sampling_params=sp)
        gen.params.CopyFrom(pre.params)
        gen.first_token.token_id = pre.first.token_ids[0]
        toks = [pre.first.token_ids[0]]
        async for chunk in pair.d.Generate(gen, FakeContext()):
            toks += list(chunk.token_ids)
        return toks

    async def run() -> tuple[list[list[int]], int]:
        pair = await make_pair(path, monkeypatch, p_config=config(False), d_config=config(True))
        try:
            got = await asyncio.gather(*(one(pair, i) for i in range(len(prompts))))
            assert pair.d.consumer.num_recomputed == 0 and len(pair.pulls) == len(prompts)

            def check(core) -> int:  # type: ignore[no-untyped-def]
                assert not core.has_unfinished() and core.pipeline.in_flight is None
                core.cache.check_integrity()
                return core.pipeline.num_ahead

            return list(got), await pair.d.ctx.aengine.acall(check)
        finally:
            pair.close()

    got, ahead = asyncio.run(run())
    assert got == want
    assert ahead > 0


def test_an_abort_between_steps_leaves_no_pages_behind(checkpoint_dir):  # type: ignore[no-untyped-def]
    """Every request of the step in flight aborted between steps (a worker's call): the engine still has work (that
    step), and reading it gives every page back."""
    _, fast = _engines(checkpoint_dir("nemotron_attn_mid"))
    core = fast.engine
    for i, p in enumerate(random_prompts([9, 14], core.vocab_size, seed=6)):
        core.add_request(f"a{i}", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    while core.pipeline.in_flight is None:
        core.step()
    for rid in ("a0", "a1"):
        core.abort(rid)
    assert core.has_unfinished() and any(h["in_use"] for h in core.pool_health())
    while core.has_unfinished():
        core.step()
    assert core.pipeline.in_flight is None and all(h["in_use"] == 0 for h in core.pool_health())


def test_async_scheduling_flag_keeps_three_states() -> None:
    """Unset (the default: the engine decides by its device), on, off; each survives a worker command line."""
    import argparse

    from hybridpd.deploy.engine_flags import add_engine_args, engine_argv, engine_config_from_args
    from hybridpd.engine.config import SchedulerConfig

    assert SchedulerConfig().async_scheduling is None
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        config = engine_config_from_args(parser.parse_args(argv))
        assert config.scheduler.async_scheduling is want
        assert engine_config_from_args(parser.parse_args(engine_argv(config)[2:])).scheduler.async_scheduling is want
