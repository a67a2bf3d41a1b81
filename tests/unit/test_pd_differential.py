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
    from hybridpd.proxy.generation import Delta
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
