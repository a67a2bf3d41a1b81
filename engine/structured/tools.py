"""The structural tag that makes a model call tools in its own syntax (tool_choice "required" or a named tool).

Both families write tool calls in the XML format of their published chat templates (Qwen3.5's and NVIDIA
Nemotron 3's templates render an assistant's `tool_calls` the same way; vLLM parses both with its qwen3_coder
parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Built from xgrammar's structural-tag formats: each call is a tag whose begin names one of the tools and whose
content is the tool's `parameters` schema in xgrammar's `qwen_xml` style (one `<parameter=name>` block per
property, strings raw, other values as JSON), so the parsed arguments always validate against the schema.
"required": one or more calls, separated by a newline (one with `parallel_tool_calls` false), nothing before them;
named: exactly that tool's call. Whitespace between blocks is bounded (`MAX_WHITESPACE`) so a model cannot pad a
call until max_tokens.

The request (JSON, built by the proxy): {"format": "qwen_3_5", "tools": [OpenAI tool objects], "tool_choice":
"required" | {"type": "function", "function": {"name": ...}}, "reasoning": "enabled" | "disabled",
"parallel_tool_calls": bool}. "enabled" when the prompt ends inside an opened `<think>` block: the model closes it
(`</think>` then a blank line) before the calls.
"""

from __future__ import annotations

from typing import Any

from hybridpd.engine.errors import InvalidRequestError

FORMATS = ("qwen_3_5",)
CALL_BEGIN = "<tool_call>\n<function={name}>\n"
CALL_END = "\n</function>\n</tool_call>"
CALL_SEPARATOR = "\n"
THINK_END = "</think>"
MAX_WHITESPACE = 2


def _tool_functions(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("invalid tool-call request: 'tools' must be a non-empty list")
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError("invalid tool-call request: every tool needs function.name")
        params = fn.get("parameters")
        out[fn["name"]] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
    return out


def tool_call_tag(request: Any) -> Any:
    """xgrammar's StructuralTag for a tool-call request (see the module doc); InvalidRequestError when malformed."""
    from xgrammar import structural_tag as st

    if not isinstance(request, dict):
        raise InvalidRequestError("invalid tool-call request: must be a JSON object")
    fmt = request.get("format")
    if fmt not in FORMATS:
        raise InvalidRequestError(f"invalid tool-call request: format must be one of {list(FORMATS)}, got {fmt!r}")
    functions = _tool_functions(request.get("tools"))

    def call(name: str) -> Any:
        content = st.JSONSchemaFormat(json_schema=functions[name], style="qwen_xml",
                                      max_whitespace_cnt=MAX_WHITESPACE)
        return st.TagFormat(begin=CALL_BEGIN.format(name=name), content=content, end=CALL_END)

    choice = request.get("tool_choice", "required")
    body: Any
    if choice == "required":
        body = st.TagsWithSeparatorFormat(tags=[call(n) for n in functions], separator=CALL_SEPARATOR,
                                          at_least_one=True,
                                          stop_after_first=not request.get("parallel_tool_calls", True))
    else:
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in functions:
            raise InvalidRequestError(f"invalid tool-call request: tool_choice names {name!r}, not one of the tools")
        body = call(name)
    if request.get("reasoning") == "enabled":
        think = st.TagFormat(begin="", content=st.AnyTextFormat(excludes=["<think>", THINK_END]), end=THINK_END)
        body = st.SequenceFormat(elements=[think, st.ConstStringFormat(value="\n\n"), body])
    return st.StructuralTag(format=body)


__all__ = ["FORMATS", "tool_call_tag"]
