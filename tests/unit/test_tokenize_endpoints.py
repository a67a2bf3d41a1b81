"""POST /tokenize, POST /detokenize, GET /version (vLLM's shapes) on the real proxy with the built-in tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.support.live_stack import LiveStack


@pytest.fixture(scope="module")
def stack() -> Iterator[LiveStack]:
    from hybridpd.engine.default_model import default_model_path

    with LiveStack(tokenizer=PromptTokenizer.from_dir(default_model_path()), api_key="k") as s:
        yield s


def _post(stack: LiveStack, path: str, body: dict) -> object:  # type: ignore[type-arg]
    return stack.http.post(f"{stack.url}{path}", json=body, headers={"Authorization": "Bearer k"})


def test_tokenize_detokenize_round_trip(stack: LiveStack) -> None:
    text = "Hello, hybrid world! ünïcode"
    r = _post(stack, "/tokenize", {"prompt": text, "return_token_strs": True})
    body = r.json()  # type: ignore[attr-defined]
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 0  # type: ignore[attr-defined]
    assert body["max_model_len"] == stack.config.max_model_len and len(body["token_strs"]) == body["count"]
    back = _post(stack, "/detokenize", {"tokens": body["tokens"]}).json()  # type: ignore[attr-defined]
    assert back == {"prompt": text}
    chat = _post(stack, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()  # type: ignore[attr-defined]
    assert chat["count"] > 2 and chat["token_strs"] is None


def test_bad_input_and_auth(stack: LiveStack) -> None:
    assert _post(stack, "/detokenize", {"tokens": [10**9]}).status_code == 400  # type: ignore[attr-defined]
    assert _post(stack, "/detokenize", {"tokens": "abc"}).status_code == 400  # type: ignore[attr-defined]
    assert _post(stack, "/tokenize", {}).status_code == 400  # type: ignore[attr-defined]
    assert _post(stack, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404  # type: ignore[attr-defined]
    assert stack.http.post(f"{stack.url}/tokenize", json={"prompt": "x"}).status_code == 401


def test_version(stack: LiveStack) -> None:
    r = stack.http.get(f"{stack.url}/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]


def test_tokenize_refuses_messages_far_past_the_context_as_it_does_a_prompt(stack: LiveStack) -> None:
    """Chat messages longer than any context tokenize no more than such a prompt does: a 400, not seconds of the
    proxy's tokenizer threads (shared with the completion endpoints) and a million-token answer."""
    tok = stack.tokenizer
    assert tok is not None and stack.config is not None
    huge = "b" * (tok.max_chars(stack.config.max_model_len) * 4 + 1)
    for body in ({"prompt": huge}, {"messages": [{"role": "user", "content": huge}]}):
        r = _post(stack, "/tokenize", body)
        assert r.status_code == 400 and "too long" in r.json()["error"]["message"], r.text[:200]  # type: ignore[attr-defined]
