"""The proxy's OpenAI API against FAKE prefill/decode gRPC workers (tests.support.fake_workers): happy paths, streaming,
usage, logprobs, the official `openai` client, auth, models/cluster/health/metrics.

The fake decode worker answers with the prompt's token ids reversed, one per chunk; the fake tokenizer is
byte-level (token id == byte value), so "hello" comes back as "olleh"."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from hybridpd.proxy.tokenization import PromptTokenizer

from tests.polling import wait_for
from tests.support.fake_workers import write_fake_tokenizer
from tests.support.live_stack import LiveStack

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def stack(tokenizer: PromptTokenizer) -> Iterator[LiveStack]:
    with LiveStack(tokenizer=tokenizer, model_name=MODEL, max_model_len=128) as s:
        yield s


def sse_events(text: str) -> list[dict | str]:
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_completion_non_stream(stack: LiveStack) -> None:
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == "olleh" and choice["finish_reason"] == "length" and choice["logprobs"] is None
    # P computed the 5 prompt tokens and D pulled them: transferred, not a cache hit (cached_tokens counts hits only).
    assert body["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0},
        "hybridpd": {"prefill_cached_tokens": 0, "transferred_tokens": 5, "decode_local_cached_tokens": 0}}
    gen = stack.decode[0].generates[-1]
    assert list(gen.prompt_token_ids) == list(b"hello") and gen.HasField("params")
    assert gen.params.num_computed_tokens == 5 and gen.params.prefill_address == stack.prefill[0].address
    assert gen.first_token.token_id == ord("o")  # P's first token (the fake's rule: the prompt reversed)


def _ttft_count(stack: LiveStack) -> float:
    lines = stack.http.get("/metrics").text.splitlines()
    name = "hybridpd_time_to_first_token_seconds_count"
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_a_first_token_that_ends_the_request_is_answered_by_p_alone(stack: LiveStack) -> None:
    """max_tokens 1, a stop token or a stop string at the first token: P's answer is the whole output, no decode
    worker is called (and nothing is left for it), and the time to first token is P's."""
    calls = len(stack.decode[0].generates)
    ttft = _ttft_count(stack)
    for extra, text, finish in (({"max_tokens": 1}, "o", "length"), ({"stop_token_ids": [ord("o")]}, "", "stop"),
                                ({"stop": ["o"]}, "", "stop"), ({"max_tokens": 1, "stream": True}, "o", "length")):
        r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5, **extra})
        assert r.status_code == 200, r.text
        if extra.get("stream"):
            assert f'"text":"{text}"' in r.text.replace(" ", "") and r.text.rstrip().endswith("data: [DONE]")
            continue
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == (text, finish, 1)
    assert len(stack.decode[0].generates) == calls  # D was never called
    assert _ttft_count(stack) == ttft + 4
    assert not stack.prefill[0].releases or stack.prefill[0].prefills[-1].request_id not in stack.prefill[0].releases


def test_completion_token_id_prompts_and_default_max_tokens(stack: LiveStack) -> None:
    for prompt in ([1, 2, 3], [[1, 2, 3]], ["abc"]):
        r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 3
    assert stack.decode[0].generates[-1].sampling_params.max_tokens == 16  # OpenAI's completions default


def test_sampling_params_reach_workers(stack: LiveStack) -> None:
    body = {"model": MODEL, "prompt": "abcdef", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
            "seed": 11, "stop": ["zz"], "stop_token_ids": [300], "ignore_eos": True, "cache_salt": "tenant-a"}
    assert stack.http.post("/v1/completions", json=body).status_code == 200
    p, d = stack.prefill[0].prefills[-1], stack.decode[0].generates[-1]
    assert p.request_id == d.request_id and p.cache_salt == d.cache_salt == "tenant-a"
    sp = d.sampling_params
    assert (sp.max_tokens, sp.top_k, sp.seed, list(sp.stop), list(sp.stop_token_ids), sp.ignore_eos) == (
        4, 7, 11, ["zz"], [300], True)
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    bare = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2})
    assert bare.status_code == 200
    sp = stack.decode[0].generates[-1].sampling_params
    assert not sp.HasField("temperature") and not sp.HasField("seed") and not sp.HasField("top_k")


def test_stop_string_and_stop_token(stack: LiveStack) -> None:
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "abcdef", "stop": "c"})
    assert r.json()["choices"][0] == {"index": 0, "text": "fed", "logprobs": None, "finish_reason": "stop",
                                      "stop_reason": "c",  # vLLM-style extras: the match, the generated ids
                                      "token_ids": [102, 101, 100, 99]}
    r = stack.http.post("/v1/completions",
                   json={"model": MODEL, "prompt": "abcdef", "stop_token_ids": [ord("d")]})
    assert r.json()["choices"][0]["text"] == "fe" and r.json()["choices"][0]["finish_reason"] == "stop"


def test_completion_stream_with_usage(stack: LiveStack) -> None:
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    r = stack.http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "dcb"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3


def test_completion_logprobs_shape(stack: LiveStack) -> None:
    r = stack.http.post("/v1/completions",
                   json={"model": MODEL, "prompt": "xyz", "max_tokens": 3, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["z", "y", "x"] and lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"] == [{"z": pytest.approx(-0.1)}, {"y": pytest.approx(-0.2)}, {"x": pytest.approx(-0.3)}]
    assert lp["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert stack.decode[0].generates[-1].sampling_params.logprobs


def test_chat_non_stream_and_logprobs(stack: LiveStack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    r = stack.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    # Fallback template "<|user|>\nhi\n<|assistant|>\n" reversed starts with "\n>".
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "\n>"}
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["\n", ">"] and content[1]["bytes"] == [62]
    assert content[0]["logprob"] == pytest.approx(-0.1) and content[0]["top_logprobs"] == []
    prompt = "<|user|>\nhi\n<|assistant|>\n"
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert list(stack.decode[0].generates[-1].prompt_token_ids) == list(prompt.encode())


def test_chat_rendering_fields_reach_the_prompt(stack: LiveStack) -> None:
    """add_generation_prompt false / continue_final_message: the prompt sent to the worker (fallback template);
    /tokenize renders alike."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    cases = [({"add_generation_prompt": False}, "<|user|>\nhi\n<|assistant|>\nSure, \n"),
             ({"continue_final_message": True}, "<|user|>\nhi\n<|assistant|>\nSure, "),
             ({"chat_template_kwargs": {"enable_thinking": False}},
              "<|user|>\nhi\n<|assistant|>\nSure, \n<|assistant|>\n")]
    for fields, prompt in cases:
        r = stack.http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text
        assert list(stack.decode[0].generates[-1].prompt_token_ids) == list(prompt.encode()), fields
        r = stack.http.post("/tokenize", json={"model": MODEL, "messages": msgs, **fields})
        assert r.status_code == 200 and r.json()["tokens"] == list(prompt.encode()), fields


def test_chat_default_max_tokens_is_rest_of_context(stack: LiveStack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = stack.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    prompt_len = len("<|user|>\nhi\n<|assistant|>\n")
    assert stack.decode[0].generates[-1].sampling_params.max_tokens == 128 - prompt_len


def test_chat_stream(stack: LiveStack) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "max_completion_tokens": 3, "stream": True}
    events = sse_events(stack.http.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "\n>|"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_client(stack: LiveStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    c = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, logprobs=0)
    assert c.choices[0].text == "ol" and c.usage is not None and c.usage.total_tokens == 7
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.tokens == ["o", "l"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=3)
    assert chat.choices[0].message.content == "\n>|" and chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    # tokens pulled from P are not a cache hit: cached_tokens is what P found in its prefix cache
    assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.model_extra["hybridpd"]["prefill_cached_tokens"]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}, logprobs=True)
    parts, usage = [], None
    for ev in stream:
        if ev.choices:
            parts.append(ev.choices[0].delta.content or "")
        usage = ev.usage or usage
    assert "".join(parts) == "\n>|" and usage is not None and usage.completion_tokens == 3
    text_stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, stream=True)
    assert "".join(ev.choices[0].text for ev in text_stream) == "cba"
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="other", prompt="x")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert bad.value.param == "max_tokens"


def test_models_cluster_health_metrics(stack: LiveStack) -> None:
    models = stack.http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 128
    assert models["data"][0]["vocab_size"] == 257
    cluster = stack.http.get("/v1/cluster").json()
    roles = {(w["role"], w["address"]): w for w in cluster["workers"]}
    p = roles[("prefill", stack.prefill[0].address)]
    assert p["reachable"] and p["metrics_port"] == 9100 and p["metrics_url"] == "http://127.0.0.1:9100/metrics"
    assert p["pools"][0] == {"group_id": 0, "kind": "attention", "total": 64, "free": 60, "cached": 2, "in_use": 2,
                             "pinned": 0, "integrity_ok": True}
    assert p["memory_bytes"] == {"physical_bytes": 1 << 20, "attention_bytes_cached": 2 << 10,
                                 "checkpoint_bytes_held": 4 << 10}
    assert roles[("decode", stack.decode[0].address)]["worker_id"] == "fake-decode-0"
    h = stack.http.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    metrics = stack.http.get("/metrics").text
    for name in ("hybridpd_time_to_first_token_seconds_bucket", "hybridpd_inter_token_latency_seconds_count",
                 "hybridpd_e2e_request_latency_seconds_sum", 'hybridpd_requests_total{status="success"}',
                 'hybridpd_proxy_in_flight_requests{role="decode"'):
        assert name in metrics, name


def test_api_key() -> None:
    with LiveStack(model_name=MODEL, api_key="sekrit") as s:
        body = {"model": MODEL, "prompt": [5, 6]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = s.http.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert s.http.get("/v1/models").status_code == 401
        # probes need no key (/health reports the background probe's last result: wait for a healthy one, as a
        # load balancer would, rather than racing the first probe on a loaded machine)
        wait_for("a healthy /health without a key", lambda: s.http.get("/health").status_code == 200, timeout=30)
        ok = s.http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " 6 5"
        assert not s.decode[0].generates[:-1]  # rejected requests never reached a worker
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekrit", max_retries=0)
        assert client.completions.create(model=MODEL, prompt=[1], max_tokens=1).choices[0].text == " 1"


def test_colocated_sends_no_params() -> None:
    with LiveStack(n_prefill=0, model_name=MODEL, colocated=True) as s:
        r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert not s.decode[0].generates[-1].HasField("params")
        assert s.http.get("/health").status_code == 200
        # no tokenizer: text prompts are refused, token ids are served
        r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": "text"})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        r = s.http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2], "text"]})  # a mixed batch
        assert r.status_code == 400 and "mixes" in r.json()["error"]["message"] and not s.decode[0].generates[1:]


def test_proxy_imports_neither_torch_nor_engine() -> None:
    """From `engine`, only the tensor-free chat-template renderer the engine's Tokenizer shares (and its errors), the
    block hashing every worker uses (the router's cache index hashes prompts the same way), the incremental
    detokenizer (logprob text offsets follow the text the workers decode), and the prompt logprobs' rules (the
    range of prompt_logprobs, -inf as -9999.0: host data only)."""
    shared = ("hybridpd.engine", "hybridpd.engine.errors", "hybridpd.engine.chat_template",
              "hybridpd.engine.cache", "hybridpd.engine.cache.hashing", "hybridpd.engine.detokenizer",
              "hybridpd.engine.prompt_logprobs")
    code = ("import sys, hybridpd.proxy.app, hybridpd.proxy.server, tests.support.live_stack; "
            "bad = [m for m in sys.modules if (m.split('.')[0] == 'torch' or m.startswith('hybridpd.engine')) "
            f"and m not in {shared!r}]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
