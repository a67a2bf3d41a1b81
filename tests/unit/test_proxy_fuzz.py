"""Hypothesis fuzz of both endpoints against FAKE workers: bodies built from the request schemas with wrong types,
out-of-range numbers, huge integers, lone surrogates and deep nesting mixed in, plus raw bytes. The property:
never a status >= 500 (and nothing unexpected counted as an error). HYBRIDPD_FUZZ_EXAMPLES sets the number of
cases per test (CI: 150 each, 450 in all; the slow run: 10,000)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hybridpd.proxy.tokenization import PromptTokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

MODEL = "tiny"
EXAMPLES = int(os.environ.get("HYBRIDPD_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path_factory.mktemp("tok")))
    with LiveStack(tokenizer=tok, model_name=MODEL, max_model_len=64, max_body_bytes=64 * 1024) as s:
        yield s


weird_text = st.one_of(st.text(max_size=12), st.sampled_from(["a\ud800b", "\udfff", "\x00", "é" * 3, "<|endoftext|>"]))
weird_int = st.one_of(st.integers(-5, 300), st.sampled_from([0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30]))
weird_num = st.one_of(weird_int, st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -0.0]))
scalar = st.one_of(st.none(), st.booleans(), weird_int, weird_num, weird_text)
anything = st.recursive(
    scalar, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(weird_text, c, max_size=3)), max_leaves=8)
token_ids = st.lists(weird_int, min_size=0, max_size=6)


def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(good, good, anything)


COMMON = {
    "model": field(st.sampled_from([MODEL, "other"])),
    "max_tokens": field(weird_int),
    "temperature": field(weird_num),
    "top_p": field(weird_num),
    "top_k": field(weird_int),
    "seed": field(weird_int),
    "n": field(st.integers(0, 4)),
    "stop": field(st.one_of(weird_text, st.lists(weird_text, max_size=3))),
    "stop_token_ids": field(token_ids),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                "continuous_usage_stats": st.booleans()})),
    "presence_penalty": field(weird_num),
    "frequency_penalty": field(weird_num),
    "repetition_penalty": field(weird_num),
    "min_tokens": field(weird_int),
    "logit_bias": field(st.dictionaries(st.one_of(weird_text, st.integers(0, 400).map(str)), weird_num, max_size=3)),
    "include_stop_str_in_output": field(st.booleans()),
    "ignore_eos": field(st.booleans()),
    "user": field(weird_text),
    "cache_salt": field(weird_text),
    "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "prompt_logprobs": field(weird_int),
    "echo": field(st.booleans()),
}
COMPLETION = st.fixed_dictionaries({}, optional={
    **COMMON,
    "prompt": field(st.one_of(weird_text, token_ids, st.lists(st.one_of(weird_text, token_ids), max_size=3))),
    "logprobs": field(weird_int),
    "best_of": field(weird_int),
})
message = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "system", "assistant", "tool"])),
                                 "content": field(st.one_of(weird_text, st.lists(
                                     st.fixed_dictionaries({"type": st.just("text"), "text": weird_text}),
                                     max_size=2)))})
CHAT = st.fixed_dictionaries({}, optional={
    **COMMON,
    "messages": field(st.lists(message, max_size=3)),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(weird_int),
    "max_completion_tokens": field(weird_int),
})


def check(stack: LiveStack, path: str, content: bytes) -> None:
    r = stack.http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (content[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as \\udXXX escapes


@FUZZ
@given(body=COMPLETION)
def test_fuzz_completions(stack: LiveStack, body: dict[str, Any]) -> None:
    check(stack, "/v1/completions", encode(body))


@FUZZ
@given(body=CHAT)
def test_fuzz_chat(stack: LiveStack, body: dict[str, Any]) -> None:
    check(stack, "/v1/chat/completions", encode(body))


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), anything.map(lambda v: json.dumps(v).encode()),
                     st.integers(1, 20_000).map(lambda d: b"[" * d + b"]" * d),
                     st.integers(1, 20_000).map(lambda d: b'{"prompt":' * d + b"1" + b"}" * d)))
def test_fuzz_raw_bytes(stack: LiveStack, raw: bytes) -> None:
    check(stack, "/v1/completions" if len(raw) % 2 else "/v1/chat/completions", raw)


def test_no_error_counted_after_fuzzing(stack: LiveStack) -> None:
    """Runs after the fuzz tests in this module (same stack): no 5xx happened, so none was counted."""
    line = next(x for x in stack.http.get("/metrics").text.splitlines()
                if x.startswith('hybridpd_requests_total{status="error"'))
    assert float(line.split()[-1]) == 0.0
    assert stack.http.get("/health").status_code == 200
