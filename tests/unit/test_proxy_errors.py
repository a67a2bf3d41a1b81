"""Bad input gets the right 4xx with an OpenAI-style error body, never reaches a worker, and leaves the cluster
serving. Runs against FAKE workers (tests.support.fake_workers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

MODEL = "tiny"
MAX_LEN = 32
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path_factory.mktemp("tok")))
    with LiveStack(tokenizer=tok, model_name=MODEL, max_model_len=MAX_LEN, max_body_bytes=4096) as s:
        yield s


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", **kw}


def deep_schema(levels: int) -> dict[str, Any]:
    """`levels` nested arrays (more than the default --max-schema-depth of 64)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, **kw}


# (path, body, status, param, code) -- param/code None: not checked
CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    (CMPL, cmpl(model="gpt-4"), 404, "model", "model_not_found"),
    (CHAT, chat(model="gpt-4"), 404, "model", "model_not_found"),
    (CMPL, cmpl(max_tokens=0), 400, "max_tokens", None),
    (CMPL, cmpl(max_tokens=-3), 400, "max_tokens", None),
    (CMPL, cmpl(max_tokens="5"), 400, "max_tokens", None),
    (CMPL, cmpl(max_tokens=2.5), 400, "max_tokens", None),
    (CMPL, cmpl(max_tokens=True), 400, "max_tokens", None),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    (CMPL, cmpl(temperature="hot"), 400, "temperature", None),
    (CMPL, cmpl(temperature=-0.1), 400, "temperature", None),
    (CMPL, cmpl(temperature=2.5), 400, "temperature", None),  # vLLM (and OpenAI): [0, 2]
    (CHAT, chat(temperature=3), 400, "temperature", None),
    # vLLM parameters the engine does not implement: refused when set, never silently ignored
    (CMPL, cmpl(min_p=1.5), 400, "min_p", None),
    (CHAT, chat(min_p=-0.1), 400, "min_p", None),
    (CMPL, cmpl(min_p="0.1"), 400, "min_p", None),
    (CHAT, chat(use_beam_search=True), 400, "use_beam_search", "unsupported_parameter"),
    (CMPL, cmpl(priority=1), 400, "priority", "unsupported_parameter"),
    (CMPL, cmpl(allowed_token_ids=[]), 400, "allowed_token_ids", None),
    (CMPL, cmpl(allowed_token_ids=[-1]), 400, "allowed_token_ids", None),
    (CHAT, chat(allowed_token_ids=["1"]), 400, "allowed_token_ids", None),
    (CMPL, cmpl(allowed_token_ids=3), 400, "allowed_token_ids", None),
    (CMPL, cmpl(allowed_token_ids=[1, 100000]), 400, "allowed_token_ids", None),  # outside the vocabulary
    (CHAT, chat(bad_words=["x", " "]), 400, "bad_words", None),
    (CMPL, cmpl(bad_words="x"), 400, "bad_words", None),
    (CMPL, cmpl(bad_words=[f"w{i}" for i in range(129)]), 400, "bad_words", None),
    (CMPL, cmpl(truncate_prompt_tokens=2), 400, "truncate_prompt_tokens", "unsupported_parameter"),
    # vLLM chat-rendering extras the proxy does not implement: refused rather than rendering another prompt
    (CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs", None),
    (CHAT, chat(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs", None),
    (CHAT, chat(chat_template_kwargs={"_x": 1}), 400, "chat_template_kwargs", None),
    (CHAT, chat(add_generation_prompt="no"), 400, "add_generation_prompt", None),
    (CHAT, chat(continue_final_message=True, add_generation_prompt=True), 400, "continue_final_message", None),
    (CHAT, chat(chat_template="{{ 'x' }}"), 400, "chat_template", "unsupported_parameter"),
    (CHAT, chat(documents=[{"text": "x"}]), 400, "documents", "unsupported_parameter"),
    (CHAT, chat(echo="yes"), 400, "echo", None),
    (CHAT, chat(prompt_logprobs=21), 400, "prompt_logprobs", None),
    (CMPL, cmpl(top_p=0), 400, "top_p", None),
    (CMPL, cmpl(top_p=1.5), 400, "top_p", None),
    (CHAT, chat(top_p=-1), 400, "top_p", None),
    (CMPL, cmpl(top_k=-5), 400, "top_k", None),
    (CMPL, cmpl(seed="x"), 400, "seed", None),
    (CMPL, cmpl(stream="yes"), 400, "stream", None),
    (CMPL, cmpl(stream_options={"include_usage": True}), 400, "stream_options", None),
    (CMPL, cmpl(stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage", None),
    (CMPL, cmpl(stop=5), 400, "stop", None),
    (CMPL, cmpl(stop=[""]), 400, "stop", None),
    (CMPL, cmpl(stop_token_ids=["a"]), 400, "stop_token_ids", None),
    (CMPL, cmpl(ignore_eos="true"), 400, "ignore_eos", None),
    (CMPL, cmpl(logprobs=True), 400, "logprobs", None),
    (CMPL, cmpl(logprobs=-1), 400, "logprobs", None),
    (CHAT, chat(logprobs=1), 400, "logprobs", None),
    (CMPL, cmpl(n=129), 400, "n", None),
    (CHAT, chat(n="3"), 400, "n", None),
    (CMPL, cmpl(n=0), 400, "n", None),
    (CMPL, cmpl(best_of=2), 400, "best_of", "unsupported_parameter"),
    (CMPL, cmpl(logit_bias={"50": "1"}), 400, "logit_bias", None),
    (CMPL, cmpl(logit_bias={"x": 1}), 400, "logit_bias", None),
    (CMPL, cmpl(logit_bias={"100000": 1}), 400, "logit_bias", None),
    (CMPL, cmpl(logit_bias=[1]), 400, "logit_bias", None),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400, "tools[0].function.name", None),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice", None),
    (CMPL, cmpl(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unsupported_parameter"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema", None),
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", None),
    (CHAT, chat(guided_regex="a", guided_choice=["a"]), 400, "guided_choice", None),
    (CHAT, chat(structured_outputs={"choice": "a"}), 400, "structured_outputs.choice", None),
    (CHAT, chat(guided_json=deep_schema(80)), 400, "guided_json", "limit_exceeded"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep_schema(80)}}],
                tool_choice="required"), 400, "tools", "limit_exceeded"),
    (CMPL, cmpl(prompt_logprobs=-3), 400, "prompt_logprobs", None),
    (CMPL, cmpl(prompt_logprobs=2, stream=True), 400, "prompt_logprobs", None),
    (CMPL, cmpl(presence_penalty=2.5), 400, "presence_penalty", None),
    (CMPL, cmpl(frequency_penalty="1"), 400, "frequency_penalty", None),
    (CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty", None),
    (CMPL, cmpl(min_tokens=-1), 400, "min_tokens", None),
    (CMPL, cmpl(min_tokens=5, max_tokens=2), 400, "min_tokens", None),
    (CMPL, cmpl(include_stop_str_in_output=1), 400, "include_stop_str_in_output", None),
    (CMPL, cmpl(logprobs=21), 400, "logprobs", None),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs", None),
    (CHAT, chat(top_logprobs=21, logprobs=True), 400, "top_logprobs", None),
    (CMPL, cmpl(max_tokens=2**70), 400, "max_tokens", None),
    (CMPL, cmpl(temperature=10**400), 400, "temperature", None),
    (CMPL, {"model": MODEL}, 400, "prompt", None),
    (CMPL, cmpl(prompt=""), 400, "prompt", None),
    (CMPL, cmpl(prompt=[]), 400, "prompt", None),
    (CMPL, cmpl(prompt=[[]]), 400, "prompt", None),
    (CMPL, cmpl(prompt=["a", ""]), 400, "prompt", None),
    (CMPL, cmpl(prompt=["a"] * 257), 400, "prompt", None),
    (CMPL, cmpl(prompt=["a", 5]), 400, "prompt", None),
    (CMPL, cmpl(prompt=[1, "a"]), 400, "prompt", None),
    (CMPL, cmpl(prompt=[[1, 2], "x"]), 400, "prompt", None),  # vLLM: a batch is all strings or all token lists
    (CMPL, cmpl(prompt=["x", [1, 2]]), 400, "prompt", None),
    (CMPL, cmpl(prompt=[-1]), 400, "prompt", None),
    (CMPL, cmpl(prompt=[100000]), 400, "prompt", None),
    (CMPL, cmpl(prompt=7), 400, "prompt", None),
    (CMPL, cmpl(prompt="x" * MAX_LEN), 400, "prompt", "context_length_exceeded"),
    (CMPL, cmpl(prompt="x" * 20, max_tokens=MAX_LEN + 1), 400, "max_tokens", "context_length_exceeded"),
    (CHAT, chat(max_completion_tokens=MAX_LEN + 1), 400, "max_tokens", "context_length_exceeded"),
    (CMPL, cmpl(prompt="x" * 20, min_tokens=13), 400, "min_tokens", None),  # the rest of the context: 12 tokens
    (CHAT, chat(messages=[]), 400, "messages", None),
    (CHAT, {"model": MODEL}, 400, "messages", None),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0]", None),
    (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]), 400,
     "messages[0].tool_calls", None),
    (CHAT, chat(messages=["hi"]), 400, "messages[0]", None),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * 40}]), 400, "prompt", "context_length_exceeded"),
    (CMPL, [1, 2], 400, None, "invalid_json"),
    (CMPL, "hello", 400, None, "invalid_json"),
]


def post(stack: LiveStack, path: str, body: Any) -> httpx.Response:
    return stack.http.post(path, json=body)


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), CASES,
                         ids=[f"{i}-{c[3] or c[4]}" for i, c in enumerate(CASES)])
def test_bad_request(stack: LiveStack, path: str, body: Any, status: int, param: str | None,
                     code: str | None) -> None:
    before = len(stack.decode[0].generates), len(stack.prefill[0].prefills)
    r = post(stack, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
        assert param.split(".")[0].split("[")[0] in err["message"] or status == 404
    if code is not None:
        assert err["code"] == code
    assert (len(stack.decode[0].generates), len(stack.prefill[0].prefills)) == before


def test_unsupported_params_are_all_named(stack: LiveStack) -> None:
    r = post(stack, CMPL, cmpl(best_of=3, suffix="x"))
    assert r.status_code == 400 and "'best_of'" in r.json()["error"]["message"]
    assert "'suffix'" in r.json()["error"]["message"]
    r = post(stack, CHAT, chat(structured_outputs={"structural_tag": "{}"}))
    assert r.status_code == 400 and "'structured_outputs.structural_tag'" in r.json()["error"]["message"]


def test_integer_bounds_are_named_right(stack: LiveStack) -> None:
    err = post(stack, CMPL, cmpl(max_tokens=2**70)).json()["error"]
    assert "in [1, 9223372036854775807], got 1180591620717411303424" in err["message"]
    err = post(stack, CMPL, cmpl(max_tokens=0)).json()["error"]
    assert "'max_tokens' must be >= 1, got 0" in err["message"]


def test_max_tokens_past_the_context_is_cut_to_it(stack: LiveStack) -> None:
    """vLLM (0.33): max_tokens up to max_model_len is capped at what the prompt leaves of the context (the answer
    ends "length" there); only more than max_model_len, or a prompt that leaves no room, is a 400."""
    r = post(stack, CMPL, cmpl(prompt="x" * 20, max_tokens=MAX_LEN, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert stack.prefill[0].prefills[-1].sampling_params.max_tokens == MAX_LEN - 20
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = post(stack, CMPL, cmpl(prompt="x" * 20, max_tokens=MAX_LEN - 19, min_tokens=12))
    assert r.status_code == 200, r.text


def test_logit_bias_values_are_clamped_to_100(stack: LiveStack) -> None:
    """vLLM clamps each bias to [-100, 100] (a client banning a token with -1e9 is served, not refused)."""
    r = post(stack, CMPL, cmpl(max_tokens=2, logit_bias={"50": 1e9, "51": -1e9, "52": -3.5}))
    assert r.status_code == 200, r.text
    assert dict(stack.prefill[0].prefills[-1].sampling_params.logit_bias) == {50: 100.0, 51: -100.0, 52: -3.5}


def test_min_p_allowed_token_ids_and_bad_words_reach_both_workers(stack: LiveStack) -> None:
    """The prefill worker samples the first token: both workers get the fields, and convert them to the engine's."""
    from hybridpd.worker.convert import sampling_params_from_proto

    body = cmpl(max_tokens=3, temperature=0.8, min_p=0.25, allowed_token_ids=[5, 7, 9], bad_words=["ab", "c d"])
    assert post(stack, CMPL, body).status_code == 200
    for sent in (stack.prefill[0].prefills[-1].sampling_params, stack.decode[0].generates[-1].sampling_params):
        params = sampling_params_from_proto(sent)
        assert params.min_p == 0.25 and params.allowed_token_ids == (5, 7, 9) and params.bad_words == ("ab", "c d")
    assert post(stack, CHAT, chat(max_tokens=2)).status_code == 200
    params = sampling_params_from_proto(stack.decode[0].generates[-1].sampling_params)
    assert params.min_p == 0.0 and params.allowed_token_ids is None and params.bad_words == ()


def test_no_op_defaults_accepted(stack: LiveStack) -> None:
    body = cmpl(best_of=1, n=1, logit_bias={}, presence_penalty=0, frequency_penalty=0.0, echo=False, tools=None,
                response_format={"type": "text"}, user="u", some_future_field=1, max_tokens=2, min_p=0.0,
                use_beam_search=False, priority=0, allowed_token_ids=None, bad_words=[], truncate_prompt_tokens=None,
                temperature=2)
    assert post(stack, CMPL, body).status_code == 200
    body = chat(max_tokens=2, chat_template_kwargs={}, add_generation_prompt=True, continue_final_message=False,
                chat_template=None, documents=None, echo=False)
    assert post(stack, CHAT, body).status_code == 200
    for path, body in ((CMPL, cmpl(max_tokens=2)), (CHAT, chat(max_tokens=2))):  # vLLM: stream_options {} = none
        assert post(stack, path, {**body, "stream_options": {}}).status_code == 200


def test_malformed_json(stack: LiveStack) -> None:
    for raw in (b"{not json", b"", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', b"\xff\xfe"):
        r = stack.http.post(CMPL, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        assert r.json()["error"]["code"] == "invalid_json"


def test_oversized_body(stack: LiveStack) -> None:
    r = post(stack, CMPL, cmpl(prompt="x" * 5000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # chunked upload: no content-length to reject early
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = stack.http.post(CMPL, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_workers_keep_serving_after_errors(stack: LiveStack) -> None:
    for path, body, *_ in CASES[::7]:
        post(stack, path, body)
    r = post(stack, CMPL, cmpl(max_tokens=3))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "oll"
    r = post(stack, CHAT, chat(max_tokens=1, stream=True))
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    metrics = stack.http.get("/metrics").text
    invalid = next(line for line in metrics.splitlines() if line.startswith('hybridpd_requests_total{status="invalid"'))
    assert float(invalid.split()[-1]) >= 8
    cluster = stack.http.get("/v1/cluster").json()
    assert all(w["in_flight"] == 0 for w in cluster["workers"])


def test_unknown_route_and_method_are_openai_errors(stack: LiveStack) -> None:
    r = stack.http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = stack.http.get(CMPL)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_completion_max_tokens_null_means_the_rest_of_the_context(stack: LiveStack) -> None:
    """vLLM: a completion without max_tokens gets 16; an explicit `"max_tokens": null` gets no limit but the
    context (as chat always does)."""
    assert post(stack, CMPL, cmpl(prompt="hello")).status_code == 200
    assert stack.prefill[0].prefills[-1].sampling_params.max_tokens == 16
    assert post(stack, CMPL, cmpl(prompt="hello", max_tokens=None)).status_code == 200
    assert stack.prefill[0].prefills[-1].sampling_params.max_tokens == MAX_LEN - 5
