"""Structured output and tool calls through the HTTP API of a real PD cluster (one prefill, one decode worker) on a
random-weight model: only the constraint can make the output valid."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.integration.cluster import start_cluster

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def pd(checkpoint_dir):  # type: ignore[no-untyped-def]
    c = start_cluster(checkpoint_dir("nemotron_attn_mid"))
    yield c
    c.stop()


def _chat(cluster, **body):  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": "Give me data."}], "max_tokens": 250, **body}
    return httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120)


def test_json_schema_regex_choice_json_object(pd) -> None:  # type: ignore[no-untyped-def]
    r = _chat(pd, n=2, temperature=1.0, seed=5,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    r = _chat(pd, temperature=0, structured_outputs={"regex": r"[xyz]{3}\d"}, logprobs=True)
    content = r.json()["choices"][0]["message"]["content"]
    assert re.fullmatch(r"[xyz]{3}\d", content)
    assert len(r.json()["choices"][0]["logprobs"]["content"]) >= 4
    r = _chat(pd, temperature=1.0, guided_choice=["yes", "no"])
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = httpx.post(f"{pd.url}/v1/completions", json={"prompt": "x", "max_tokens": 40, "guided_regex": "ab{3}"},
                   timeout=60)
    assert r.json()["choices"][0]["text"] == "abbb"


def test_json_schema_streamed(pd) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120, "stream": True, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    text = ""
    with httpx.stream("POST", f"{pd.url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_calls_validate(pd, choice) -> None:  # type: ignore[no-untyped-def]
    r = _chat(pd, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=1, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["tool_calls"], msg
    for call in msg["tool_calls"]:
        fn = call["function"]
        params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn["name"])
        jsonschema.validate(json.loads(fn["arguments"]), params)
    if isinstance(choice, dict):
        assert msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_tool_history_and_streamed_tool_call_deltas(pd) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 250, "stream": True, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    calls = []
    with httpx.stream("POST", f"{pd.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    calls += c["delta"].get("tool_calls") or []
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("extra, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 7}}}},
     "JSON schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex"),
    ({"guided_grammar": "root ::= nowhere"}, "grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
])
def test_malformed_constraint_is_a_400_naming_it(pd, extra, needle) -> None:  # type: ignore[no-untyped-def]
    r = _chat(pd, **extra)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
