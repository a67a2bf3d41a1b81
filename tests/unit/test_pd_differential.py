"""PD == colocated over HTTP, on a seeded random sample of OpenAI requests (benchmarks/pd_differential.py): one 1P1D
cluster and one colocated cluster per model family, real processes; every answer must agree (text, token ids,
logprobs within 1e-4, finish reasons, usage, streams put together). `python -m benchmarks.pd_differential
--requests N --seed S` runs the same comparison on many more requests."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from benchmarks.pd_differential import RequestGen, compare, start_pair, stop_all

REQUESTS = 20
"""Per family; the sample below covers chat and completions, streams, seeded sampling, n > 1 and stops at P's
first token and later (asserted, so the sample cannot quietly lose them)."""


FAMILIES = ("nemotron_attn_mid", "qwen_attn_last")
PD_FLAGS: dict[str, dict[str, list[str]]] = {"nemotron_attn_mid": {"decode_args": ["--async-scheduling"]}}
"""More flags of one family's PD cluster: its decode worker schedules asynchronously (steps launched before the
previous step's tokens are read), so its answers are compared with a synchronous colocated engine's, at no cost."""


@pytest.fixture(scope="module")
def pairs(checkpoint_dir: Any) -> Iterator[dict[str, tuple[Any, Any]]]:
    """Per family, a 1P1D cluster and a colocated one, all started at once (their start-up overlaps)."""
    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        futures = {name: pool.submit(start_pair, checkpoint_dir(name), **PD_FLAGS.get(name, {})) for name in FAMILIES}
        errors = [f.exception() for f in futures.values()]
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        if any(errors):
            raise next(e for e in errors if e is not None)
        yield started
    finally:
        stop_all([c for pair in started.values() for c in pair])


@pytest.mark.parametrize("family", FAMILIES)
def test_pd_answers_equal_colocated_on_a_random_sample(pairs: dict[str, tuple[Any, Any]], family: str) -> None:
    pd, co = pairs[family]
    gen = RequestGen(seed=3, model_name=pd.model_name)
    cases = [gen.next() for _ in range(REQUESTS)]
    statuses: dict[str, int] = {}
    bad = compare(pd.url, co.url, cases, statuses=statuses)
    assert not bad, "\n".join(f"{c.endpoint} {c.body}: {d[:4]}" for c, d in bad)
    bodies = [c.body for c in cases]
    assert any(b.get("stream") for b in bodies) and any("messages" in b for b in bodies)
    assert any(b.get("seed") is not None for b in bodies) and any(b.get("n", 1) > 1 for b in bodies)
    assert statuses.get("finish=stop", 0) >= 2 and statuses.get("finish=length", 0) >= 10, statuses


def test_completion_text_offsets_do_not_depend_on_how_the_output_was_chunked(checkpoint_dir: Any) -> None:
    """PD streams P's first token in a delta of its own; a worker holds an incomplete UTF-8 character back to a
    later delta. The offsets of a non-streamed answer must not depend on either: they are each token's start in
    the text (a character split over byte tokens starts at its first byte's token; a special token adds nothing)."""
    from hybridpd.proxy.deltas import Delta
    from hybridpd.proxy.responses import CompletionFormatter
    from hybridpd.proxy.tokenization import PromptTokenizer

    tok = PromptTokenizer.from_dir(checkpoint_dir("nemotron_attn_mid"))
    five, e1, e2 = tok.encode("5é")  # "é" is two byte tokens
    special = 264  # a reserved token: no text
    ids = (five, e1, e2, special)

    def offsets(splits: list[tuple[int, int, str]], echo: str = "") -> list[int]:
        fmt = CompletionFormatter(
            "id", 0, "m", tok.token_text, True, tok.visible_text, echo=[echo] if echo else (), decode=tok.decode
        )
        deltas = [Delta(ids[a:b], text, (0.0,) * (b - a), None) for a, b, text in splits]
        body = fmt.full([deltas], [])
        assert body["choices"][0]["text"] == echo + "5é"
        return body["choices"][0]["logprobs"]["text_offset"]  # type: ignore[no-any-return]

    def streamed(splits: list[tuple[int, int, str]], ids: tuple[int, ...] = ids) -> list[int]:
        fmt = CompletionFormatter("id", 0, "m", tok.token_text, True, tok.visible_text, decode=tok.decode)
        return [
            o
            for a, b, text in splits
            for o in fmt.chunk(0, Delta(ids[a:b], text, (0.0,) * (b - a), None), None, False)["choices"][0]["logprobs"][
                "text_offset"
            ]
        ]

    abc = tuple(tok.encode("abc"))  # a worker holds text back that could still begin a stop string ("abX")
    assert streamed([(0, 2, ""), (2, 3, "abc")], abc) == streamed([(0, 3, "abc")], abc) == [0, 1, 2]

    want = [0, 1, 1, 2]
    assert streamed([(0, 1, "5"), (1, 2, ""), (2, 4, "é")]) == want
    assert streamed([(0, 2, "5"), (2, 3, "é"), (3, 4, "")]) == want
    assert offsets([(0, 4, "5é")]) == want  # colocated, one delta
    assert offsets([(0, 1, "5"), (1, 2, ""), (2, 4, "é")]) == want  # PD: P's token, then "é" held back a delta
    assert offsets([(0, 2, "5"), (2, 3, "é"), (3, 4, "")]) == want
    assert offsets([(0, 1, "5"), (1, 4, "é")], echo="ab") == [2 + o for o in want]


def _transformers_scores(path: str, ids: list[int]):  # type: ignore[no-untyped-def]
    """log_softmax of transformers' uncached forward over `ids` (fp32): row i scores token i + 1."""
    import torch

    from tests.oracle import hf_model

    with torch.inference_mode():
        return torch.log_softmax(hf_model(path)(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)


def _assert_prompt_logprobs(got: list[Any], ids: list[int], ref: Any, k: int) -> None:
    """vLLM's shape (None, then {token id: {logprob, rank, decoded_token}} with the prompt token first and the top
    k), every value within 1e-4 of transformers, ranks and the top k as transformers orders them."""
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        row, want = got[i], ref[i - 1]
        assert list(row)[0] == str(ids[i])
        assert abs(row[str(ids[i])]["logprob"] - want[ids[i]].item()) < 1e-4
        assert row[str(ids[i])]["rank"] == int((want >= want[ids[i]]).sum())
        top = want.topk(k)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1):
            assert row[str(t)]["rank"] == r and abs(row[str(t)]["logprob"] - v) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_pd_equal_colocated_and_transformers(
    pairs: dict[str, tuple[Any, Any]], family: str, checkpoint_dir: Any
) -> None:
    """Prompt logprobs over HTTP: P scores the prompt under PD, the colocated engine itself; both match transformers
    (fp32, 1e-4), and a repeat (its prompt now in both prefix caches) gives the same scores, none read from a cache.
    Echo with logprobs puts them in front of the output's, the first token's null."""
    import httpx

    from tests.oracle import random_prompts

    pd, co = pairs[family]
    path = checkpoint_dir(family)
    ref_model_vocab = _transformers_scores(path, [1]).shape[-1]
    ids = random_prompts([41], ref_model_vocab, seed=7)[0]
    ref = _transformers_scores(path, ids)
    body = {"model": pd.model_name, "prompt": ids, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 3,
            "logprobs": 2, "echo": True}
    with httpx.Client(timeout=60) as client:
        answers = [client.post(f"{url}/v1/completions", json=body) for url in (pd.url, co.url, pd.url, co.url)]
        chat = [client.post(f"{url}/v1/chat/completions", json={
            "model": pd.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 1}) for url in (pd.url, co.url)]
        score = {"model": pd.model_name, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}  # a harness's
        scoring = [client.post(f"{url}/v1/completions", json=score) for url in (pd.url, co.url)]
    for r in scoring:
        lp = r.json()["choices"][0]["logprobs"]
        assert r.status_code == 200 and len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert all(abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-4 for i in range(1, len(ids)))
    for r in answers + chat:
        assert r.status_code == 200, r.text
    choices = [r.json()["choices"][0] for r in answers]
    for c in choices:
        _assert_prompt_logprobs(c["prompt_logprobs"], ids, ref, 3)
        lp = c["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(ids) + 3
        assert all(abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-4 for i in range(1, len(ids)))
        assert c["token_ids"] == choices[0]["token_ids"]
    usages = [r.json()["usage"] for r in answers]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 0, 0, 0]  # no prefix cache read
    assert usages[0]["hybridpd"]["transferred_tokens"] > 0  # PD: P computed (and scored) the prompt
    pd_chat, co_chat = (r.json() for r in chat)
    assert pd_chat["prompt_logprobs"][0] is None
    assert len(pd_chat["prompt_logprobs"]) == pd_chat["usage"]["prompt_tokens"]
    for a, b in zip(pd_chat["prompt_logprobs"][1:], co_chat["prompt_logprobs"][1:], strict=True):
        assert a.keys() == b.keys() and all(abs(a[t]["logprob"] - b[t]["logprob"]) < 1e-4 for t in a)
