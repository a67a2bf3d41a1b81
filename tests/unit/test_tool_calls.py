"""Tool calling on the proxy side: request parsing, the XML tool-call parser, streamed tool_calls deltas, and the
published templates' rendering of tool history."""

from __future__ import annotations

import json

import pytest
from hybridpd.engine.chat_template import ChatTemplate
from hybridpd.proxy.errors import ApiError
from hybridpd.proxy.openai_schema import parse_chat
from hybridpd.proxy.tools import ToolStream, parse_output, parse_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}}}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=opts>\n{\"metric\": true}\n</parameter>\n</function>\n</tool_call>")


def _body(**extra):  # type: ignore[no-untyped-def]
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


def test_tool_choice_forms() -> None:
    assert parse_tools(_body(tools=TOOLS)).choice == "auto"  # type: ignore[union-attr]
    named = parse_tools(_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named is not None and named.choice == "named" and named.named == "get_weather"
    assert parse_tools(_body(tools=TOOLS, tool_choice="required")).constrained  # type: ignore[union-attr]
    assert parse_tools(_body(tool_choice="none")) is None
    for bad in ({"tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "sometimes"},
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
                {"tools": [{"type": "function", "function": {"name": "has space"}}]},
                {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}):
        with pytest.raises(ApiError) as e:
            parse_chat(_body(**bad), "m")
        assert e.value.status == 400


def test_parse_output_types_values_by_schema() -> None:
    spec = parse_tools(_body(tools=TOOLS))
    assert spec is not None
    content, calls = parse_output("Let me check.\n" + CALL, spec)
    assert content == "Let me check.\n"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "New York", "days": 3, "opts": {"metric": True}}
    assert parse_output("no call here", spec) == ("no call here", [])
    assert parse_output(CALL[:40], spec) == (CALL[:40], [])  # an unfinished call stays text


@pytest.mark.parametrize("cut", [1, 3, 7, 11, 50, 10**4])
@pytest.mark.parametrize("text", ["ok " + CALL + "\n" + CALL, "ok <tool_call>oops</tool_call> " + CALL + CALL],
                         ids=["two-calls", "a-malformed-call-first"])
def test_stream_deltas_equal_whole_parse(cut: int, text: str) -> None:
    """Streamed or whole, the same content and calls; a malformed call before good ones is dropped from both (the
    stream used to hold it, find no call starting there, and flush everything as text at the end)."""
    spec = parse_tools(_body(tools=TOOLS))
    assert spec is not None
    stream = ToolStream(spec)
    content, calls = "", []
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for i, piece in enumerate(pieces):
        c, k = stream.feed(piece, final=i == len(pieces) - 1)
        content += c
        calls += k
    whole_content, whole_calls = parse_output(text, spec)
    assert content == whole_content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


def test_history_with_tool_calls_renders_in_a_qwen_style_template() -> None:
    """An assistant's tool_calls reach the template with arguments as an object (as vLLM passes them) and tool
    messages keep their role, so a template in the published Qwen3.5 style renders both."""
    template = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments|items %}"
        "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if tools %}TOOLS:{{ tools|map(attribute='function.name')|join(',') }}{% endif %}")
    req = parse_chat({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}], "tools": TOOLS}, "m")
    text = template.render([m.as_dict() for m in req.messages], tools=list(req.tools.tools))  # type: ignore[union-attr]
    assert "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>" in text
    assert "<|im_start|>tool\nrain<|im_end|>" in text and text.endswith("TOOLS:get_weather")
    with pytest.raises(ApiError):
        parse_chat({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
                   "m")
