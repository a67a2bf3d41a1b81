"""Review probes of a decode worker resuming another's request (GenerateRequest.resume): stop strings whose match
spans what the lost worker streamed and what the new one computes, with the text the lost worker held back."""

from __future__ import annotations

import asyncio

import pytest
from hybridpd.engine import LLM
from hybridpd.engine.default_model import default_model_path
from hybridpd.engine.detokenizer import IncrementalDetokenizer
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.worker.stream_text import streamable_end

from tests.support.pd_pair import FakeContext, engine_config, make_pair
from tests.unit.test_pd_first_token import colocated, settle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sent_text(llm: LLM, tokens: list[int], max_stop: int) -> str:
    """The text a decode worker streaming one token a chunk has sent after `tokens` (what it holds back for a stop
    string or an incomplete character is not sent yet): what the proxy has when that worker is lost."""
    detok, sent = IncrementalDetokenizer(llm.tokenizer), 0
    for n in range(1, len(tokens) + 1):
        detok.update(tokens[:n])
        sent = streamable_end(detok.text, sent, False, max_stop)
    return detok.text[:sent]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=engine_config(default_model_path()))


def test_a_stop_string_spanning_the_resume_point_ends_the_text_as_one_worker_would(llm, monkeypatch):  # type: ignore[no-untyped-def]
    prompt = llm.tokenizer.encode("The quick brown fox jumps over")
    stop = "|\x15"  # the greedy output's characters 13 and 14: the ends of output tokens 19 and 21 (none between)
    cases = []
    for include in (False, True):
        sp = pb.SamplingParams(
            max_tokens=30,
            temperature=0.0,
            ignore_eos=True,
            stop=[stop, "zzzzzzzzzzzz"],
            include_stop_str_in_output=include,
            logprobs=True,
            top_logprobs=2,
        )
        cases.append(sp)

    async def run() -> None:
        pair = await make_pair(default_model_path(), monkeypatch)
        try:
            for i, sp in enumerate(cases):
                want = colocated(llm, prompt, sp)
                assert want.finish_reason == "stop" and len(want.token_ids) == 21
                plain = pb.GenerateRequest(request_id=f"whole{i}", prompt_token_ids=prompt, sampling_params=sp)
                before = [c async for c in pair.d.Generate(plain, FakeContext())]  # type: ignore[arg-type]
                assert "".join(c.text for c in before) == want.text
                for n in (1, 11, 19, 20):  # tokens the client has: early, before the stop string, inside it
                    had = sent_text(llm, want.token_ids[:n], max_stop=12)
                    if n == 20:  # the lost worker held back the stop string's first character
                        assert len(had) < len(llm.tokenizer.decode(want.token_ids[:n]))
                    req = pb.GenerateRequest(request_id=f"resumed{i}-{n}", prompt_token_ids=prompt, sampling_params=sp)
                    req.first_token.token_id, req.first_token.logprob = want.token_ids[0], want.logprobs[0]
                    req.resume.token_ids.extend(want.token_ids[1:n])
                    req.resume.text_chars = len(had)
                    chunks = [c async for c in pair.d.Generate(req, FakeContext())]  # type: ignore[arg-type]
                    assert [t for c in chunks for t in c.token_ids] == want.token_ids[n:]
                    assert had + "".join(c.text for c in chunks) == want.text, (n, had)
                    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_string == stop
                    got = [x for c in chunks for x in c.logprobs]
                    assert got == pytest.approx(want.logprobs[n:], abs=1e-4)
                    tops = [list(t.token_ids) for c in chunks for t in c.top_logprobs]
                    assert tops == [[t for t, _ in top] for top in want.top_logprobs[n:]]
            await settle(pair)
        finally:
            pair.close()

    asyncio.run(run())
