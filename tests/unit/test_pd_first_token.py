"""The prefill worker samples the first output token, and the decode worker continues from it: PD output equals a
colocated engine's, token for token, for seeded sampling with penalties, min_tokens, logit bias, min_p, bad_words
and logprobs, structured output, allowed_token_ids, and stop strings that span the first and second token; a first
token that ends the request leaves nothing leased and needs no decode worker; a block-aligned prompt D holds whole
pulls only the state; a failed pull recomputes the prompt and the first token with the same result. Driven in one
process on the built-in model (it has a tokenizer) with the pair of tests/support."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from hybridpd.engine import LLM
from hybridpd.engine.core import EngineCore
from hybridpd.engine.default_model import default_model_path
from hybridpd.engine.request import RequestOutput
from hybridpd.kvtransfer.pull import PullResult, PullState
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.worker.convert import sampling_params_from_proto

from tests.support.pd_pair import Aborted, FakeContext, FakeHandle, Pair, engine_config, make_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDED = dict(
    max_tokens=10,
    temperature=0.9,
    top_p=0.95,
    top_k=40,
    seed=1234,
    presence_penalty=0.6,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
    min_tokens=4,
    logprobs=True,
    top_logprobs=3,
    logit_bias={7: 2.5, 11: -3.0},
    min_p=0.05,
    bad_words=[" the", "jumps over the"],
)
JSON = pb.StructuredOutput(
    kind="json",
    spec='{"type": "object", "properties": {"n": {"type": "integer"}}, '
    '"required": ["n"], "additionalProperties": false}',
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=engine_config(default_model_path()))


def colocated(llm: LLM, prompt: list[int], sp: pb.SamplingParams) -> RequestOutput:
    return llm.generate(prompt_token_ids=[prompt], sampling_params=sampling_params_from_proto(sp))[0]


async def through_pd(pair: Pair, rid: str, prompt: list[int], sp: pb.SamplingParams) -> dict[str, Any]:
    """P's Prefill, then (unless its first token ended the request) D's Generate continuing from that token, as the
    proxy drives them. Returns the output as the client sees it, and whether D was called."""
    resp = await pair.p.Prefill(
        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp), FakeContext()
    )  # type: ignore[arg-type]
    chunks = [resp.first]
    if not resp.first.finish_reason:
        first = pb.FirstToken(token_id=resp.first.token_ids[0], logprob=resp.first.logprobs[0])
        if resp.first.top_logprobs:
            first.top_logprobs.CopyFrom(resp.first.top_logprobs[0])
        req = pb.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, sampling_params=sp, params=resp.params, first_token=first
        )
        chunks += [c async for c in pair.d.Generate(req, FakeContext())]  # type: ignore[arg-type]
    return {
        "tokens": [t for c in chunks for t in c.token_ids],
        "logprobs": [x for c in chunks for x in c.logprobs],
        "top": [list(t.token_ids) for c in chunks for t in c.top_logprobs],
        "text": "".join(c.text for c in chunks),
        "finish": chunks[-1].finish_reason,
        "called_d": len(chunks) > 1,
        "response": resp,
    }


def assert_same(got: dict[str, Any], want: RequestOutput, sp: pb.SamplingParams) -> None:
    assert got["tokens"] == want.token_ids and got["text"] == want.text and got["finish"] == want.finish_reason
    if sp.logprobs:  # (P always sends the first token's; D only when asked)
        assert got["logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
        assert got["top"] == [[t for t, _ in top] for top in want.top_logprobs]


async def settle(pair: Pair) -> None:
    def check(core: EngineCore) -> list[int]:
        assert not core.has_unfinished()
        core.cache.check_integrity()
        return [int(s["in_use"]) for s in core.cache.pool_stats()]

    assert not any(await pair.p.ctx.aengine.acall(check)), "P holds pages after every request ended"
    await pair.d.ctx.aengine.acall(check)
    assert len(pair.p.leases) == 0 and not pair.p.held and not pair.d.consumer.pending


def test_pd_continues_from_p_first_token_exactly_as_colocated(llm, monkeypatch):  # type: ignore[no-untyped-def]
    tok = llm.tokenizer
    prompts = [tok.encode(text) for text in ("The quick brown fox jumps over", "Write a JSON object now:")]
    seeded = pb.SamplingParams(**SEEDED)  # type: ignore[arg-type]
    greedy_json = pb.SamplingParams(max_tokens=24, temperature=0.0, structured_output=JSON)
    sampled_json = pb.SamplingParams(max_tokens=24, temperature=1.0, seed=5, structured_output=JSON)
    allowed = sorted(set(tok.encode(" the cat sat on a mat")))
    greedy_allowed = pb.SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=allowed)

    async def run() -> None:
        pair = await make_pair(default_model_path(), monkeypatch)
        try:
            for i, (prompt, sp) in enumerate(
                [
                    (prompts[0], seeded),
                    (prompts[1], greedy_json),
                    (prompts[1], sampled_json),
                    (prompts[0], greedy_allowed),
                ]
            ):
                got = await through_pd(pair, f"r{i}", prompt, sp)
                assert got["called_d"] and pair.d.consumer.num_recomputed == 0
                assert_same(got, colocated(llm, prompt, sp), sp)
            assert set(got["tokens"]) <= set(allowed) and len(got["tokens"]) == 6
            assert len(pair.pulls) == 4
            # a block-aligned prompt D has cached whole: it pulls the recurrent state alone (no attention block)
            aligned, greedy = (prompts[0] * 8)[:32], pb.SamplingParams(max_tokens=4, temperature=0.0)
            for rid in ("aligned-1", "aligned-2"):
                assert_same(await through_pd(pair, rid, aligned, greedy), colocated(llm, aligned, greedy), greedy)
            assert not any(pair.pulls[-1].src_blocks.values()) and pair.d.consumer.num_recomputed == 0

            # the pull fails: D recomputes the prompt and P's first token, and continues identically
            def failed(self: FakeHandle) -> PullState:
                self.result = PullResult(self.spec.request_id, PullState.FAILED, "recompute", 0, 0, 0.0, "injected")
                return PullState.FAILED

            monkeypatch.setattr(FakeHandle, "poll", failed)
            got = await through_pd(pair, "failed-pull", prompts[0], seeded)
            assert pair.d.consumer.num_recomputed == 1
            assert_same(got, colocated(llm, prompts[0], seeded), seeded)
            pair.p.ctx.aengine.call(lambda c: pair.p._release("failed-pull")).result()  # its lease: D never committed
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_a_first_token_that_ends_the_request_never_reaches_d(llm, monkeypatch):  # type: ignore[no-untyped-def]
    """max_tokens 1, the first token a stop token, a stop string within the first token; and a stop string spanning
    the first and second tokens (D must see the first token's text, and P must hold it back as D would), also one
    the first token holds but min_tokens defers (the text ends at the later match, on D as colocated). The logit
    bias makes every output token "a" (the built-in tokenizer is byte-level)."""
    prompt = llm.tokenizer.encode("Once upon a time there was")
    a = llm.tokenizer.encode("a")[-1]

    def sp(**kw: Any) -> pb.SamplingParams:
        return pb.SamplingParams(**{"max_tokens": 6, "temperature": 0.0, "logit_bias": {a: 100.0}, **kw})

    ends_at_one = {
        "length": sp(max_tokens=1, logprobs=True),
        "stop token": sp(stop_token_ids=[a]),
        "stop string": sp(stop=["a"], include_stop_str_in_output=True),
    }
    spanning = [sp(stop=["aa"]), sp(stop=["aa"], include_stop_str_in_output=True), sp(stop=["aab"])]
    # a stop string the first token(s) already hold, ignored until min_tokens: the text ends at the later match
    held_by_min_tokens = [
        (sp(stop=["a"], min_tokens=2), "a"),
        (sp(stop=["a"], min_tokens=3, include_stop_str_in_output=True), "aaa"),
        (sp(stop=["aa"], min_tokens=4), "aa"),
    ]

    async def run() -> None:
        pair = await make_pair(default_model_path(), monkeypatch)
        try:
            for name, params in ends_at_one.items():
                got = await through_pd(pair, name, prompt, params)
                assert not got["called_d"] and not got["response"].HasField("params"), name
                assert len(pair.p.leases) == 0 and len(got["tokens"]) == 1, name
                assert_same(got, colocated(llm, prompt, params), params)
            for i, params in enumerate(spanning):
                got = await through_pd(pair, f"spanning{i}", prompt, params)
                assert got["called_d"] and got["response"].first.text == ""  # "a" could begin the stop string
                assert_same(got, colocated(llm, prompt, params), params)
            for i, (params, want) in enumerate(held_by_min_tokens):
                got = await through_pd(pair, f"min-tokens{i}", prompt, params)
                assert got["called_d"] and got["text"] == want, (params, got["text"])
                assert_same(got, colocated(llm, prompt, params), params)
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())


def test_a_resumed_request_goes_on_exactly_where_the_lost_decode_worker_stopped(llm, monkeypatch):  # type: ignore[no-untyped-def]
    """Another decode worker was lost after k output tokens: the proxy sends the request again with the first token
    and a `resume` (the tokens after it, the length of the text the client has). The new worker computes them with
    the prompt and streams only what follows: with what the lost worker had streamed, the colocated tokens,
    logprobs and text, for seeded sampling with penalties, min_tokens and bad words, for greedy structured output
    (the matcher replayed), and for a greedy run of bytes that are no valid UTF-8 (the text the detokenizer holds
    back depends on how the tokens came: the new worker replays them one at a time, as the lost one saw them)."""
    tok = llm.tokenizer
    fox, once = tok.encode("The quick brown fox jumps over"), tok.encode("Once upon a time in a land far away")
    json_greedy = pb.SamplingParams(max_tokens=16, temperature=0.0, structured_output=JSON)
    raw_bytes = pb.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    seeded = pb.SamplingParams(**SEEDED)  # type: ignore[arg-type]
    cases = [(fox, seeded, 5), (fox, json_greedy, 6), (once, raw_bytes, 20)]

    async def run() -> None:
        pair = await make_pair(default_model_path(), monkeypatch)
        try:
            for i, (prompt, sp, k) in enumerate(cases):
                want = colocated(llm, prompt, sp)
                plain = pb.GenerateRequest(request_id=f"whole{i}", prompt_token_ids=prompt, sampling_params=sp)
                before = [c async for c in pair.d.Generate(plain, FakeContext())]  # type: ignore[arg-type]
                assert "".join(c.text for c in before) == want.text
                while sum(len(c.token_ids) for c in before) > k:  # what the client has when the worker is lost
                    before.pop()
                k = sum(len(c.token_ids) for c in before)
                had = "".join(c.text for c in before)
                assert 1 < k < len(want.token_ids), "the case must leave output to resume"
                req = pb.GenerateRequest(request_id=f"resumed{i}", prompt_token_ids=prompt, sampling_params=sp)
                req.first_token.token_id, req.first_token.logprob = want.token_ids[0], want.logprobs[0]
                req.resume.token_ids.extend(want.token_ids[1:k])
                req.resume.text_chars = len(had)
                chunks = [c async for c in pair.d.Generate(req, FakeContext())]  # type: ignore[arg-type]
                assert [t for c in chunks for t in c.token_ids] == want.token_ids[k:]
                assert had + "".join(c.text for c in chunks) == want.text
                assert chunks[-1].finish_reason == want.finish_reason
                if sp.logprobs:
                    got = [x for c in chunks for x in c.logprobs]
                    assert got == pytest.approx(want.logprobs[k:], abs=1e-4)
            assert "\ufffd" in want.text  # (the last case's bytes are no valid UTF-8)
            greedy, prompt = pb.SamplingParams(max_tokens=8, temperature=0.0), fox
            bad_text = pb.GenerateRequest(
                request_id="bad",
                prompt_token_ids=prompt,
                sampling_params=greedy,
                first_token=pb.FirstToken(token_id=want.token_ids[0]),
                resume=pb.Resume(token_ids=want.token_ids[1:3], text_chars=10**6),
            )
            no_first = pb.GenerateRequest(
                request_id="bad",
                prompt_token_ids=prompt,
                sampling_params=greedy,
                resume=pb.Resume(token_ids=want.token_ids[1:3]),
            )
            for bad in (bad_text, no_first):  # refused as bad input; nothing is left running
                with pytest.raises(Aborted) as refused:
                    _ = [c async for c in pair.d.Generate(bad, FakeContext())]  # type: ignore[arg-type]
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())
