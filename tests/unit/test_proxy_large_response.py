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
