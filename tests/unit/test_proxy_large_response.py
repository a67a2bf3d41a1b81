"""A non-streamed response with a very large body (prompt logprobs or echo with logprobs over a long prompt, times
n) is rendered on a helper thread with an incremental encoder, not on the event loop: rendered there, a 130 MB
answer (n=32, echo, logprobs=20, 2000 prompt tokens) kept every other client, /health included, waiting for more
than 5 s. Small answers stay on the loop. Either way the body is the same JSON."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hybridpd.proxy import responses
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack() -> Iterator[LiveStack]:
    with LiveStack(model_name=MODEL) as s:
        yield s


def test_a_huge_answer_is_rendered_off_the_event_loop(stack: LiveStack, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real = responses.CompletionFormatter.full

    def spy(self: Any, *args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(responses.CompletionFormatter, "full", spy)
    prompt = [i % 200 + 1 for i in range(3000)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 20, "ignore_eos": True}
    big = stack.http.post("/v1/completions", json=body, timeout=60)
    small = stack.http.post("/v1/completions", json={**body, "prompt": prompt[:8]}, timeout=60)
    assert big.status_code == small.status_code == 200
    assert big.headers["content-type"] == small.headers["content-type"] == "application/json"
    entries = big.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt) and len(entries[1]) >= 20
    assert big.json()["choices"][0]["token_ids"] == [prompt[-1], prompt[-2]]  # (the fake: the prompt reversed)
    assert small.json()["choices"][0]["token_ids"] == [8, 7]
    assert threads[0].startswith("hybridpd-render") and not threads[1].startswith("hybridpd-render"), threads


def _events(text: str) -> list[Any]:
    import json

    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture(scope="module")
def text_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path_factory.mktemp("tok")))
    with LiveStack(tokenizer=tok, model_name=MODEL) as s:
        yield s


def test_a_huge_streamed_echo_is_rendered_off_the_event_loop(text_stack: LiveStack,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The first event of a streamed echo with logprobs over a long prompt carries the whole prompt's logprobs:
    built and encoded on the helper thread too; the later (one-token) events stay on the loop."""
    threads: list[str] = []
    real = responses.CompletionFormatter.chunk

    def spy(self: Any, *args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(responses.CompletionFormatter, "chunk", spy)
    prompt = "echo " * 600  # 3000 tokens of the byte-level tokenizer
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 20, "ignore_eos": True,
            "stream": True}
    big = text_stack.http.post("/v1/completions", json=body, timeout=60)
    big_threads, threads[:] = list(threads), []
    small = text_stack.http.post("/v1/completions", json={**body, "prompt": prompt[:8]}, timeout=60)
    assert big.status_code == small.status_code == 200
    first = _events(big.text)[0]["choices"][0]
    assert first["text"].startswith(prompt) and len(first["logprobs"]["tokens"]) == len(prompt) + 1
    assert first["logprobs"]["top_logprobs"][0] is None and len(first["logprobs"]["top_logprobs"][1]) >= 20
    assert len(_events(big.text)) == len(_events(small.text)) == 2
    assert big_threads[0].startswith("hybridpd-render"), big_threads
    assert not any(t.startswith("hybridpd-render") for t in big_threads[1:] + threads), (big_threads, threads)
