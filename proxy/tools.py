"""Tool calling: the request's `tools` / `tool_choice`, and the model's tool calls parsed out of its text.

Format: both families (NemotronH, Qwen3.5) call tools in the XML syntax of their published chat templates:

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

(strings raw, other values as JSON). The template renders `tools` into the prompt and an assistant's `tool_calls`
back into this syntax; a template that does not render tools (the built-in model's ChatML) simply leaves them out.

tool_choice: "none" (tools rendered, output is text), "auto" (output parsed: text before the first call is the
content, each complete call a tool call), "required" and a named function (output constrained by the workers'
structured-output machinery to one or more calls / that call, engine.structured.tools, so every call parses and
its arguments validate against the tool's `parameters` schema).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from hybridpd.proxy.errors import bad_request

TOOL_FORMAT = "qwen_3_5"
"""xgrammar's name of the XML tool-call format (engine.structured.tools)."""
CALL_START = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_WS = " \t\n\r"


@dataclass(frozen=True)
class ToolSpec:
    """The request's tools (OpenAI objects, parameters defaulted) and tool_choice: "none" | "auto" | "required" |
    the forced function's name (`named`)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"]["parameters"]  # type: ignore[no-any-return]
        return {}

    def structured_request(self, prompt_text: str) -> tuple[str, str]:
        """The ("tool_calls", spec) constraint for required / named (engine.structured.tools)."""
        opened = prompt_text.rstrip(_WS).endswith("<think>")
        choice: Any = "required" if self.choice == "required" else {"type": "function",
                                                                     "function": {"name": self.named}}
        return ("tool_calls", json.dumps({"format": TOOL_FORMAT, "tools": list(self.tools), "tool_choice": choice,
                                          "reasoning": "enabled" if opened else "disabled",
                                          "parallel_tool_calls": self.parallel}))


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` (400 naming the problem); None without tools."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("'tools' holds two functions of the same name", param="tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    par = parallel is not False
    if choice is None or choice in ("none", "auto", "required"):
        return ToolSpec(tools, choice or "auto", parallel=par)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_request(f"'tool_choice' names function {str(name)[:64]!r}, which is not in 'tools'",
                              param="tool_choice")
        return ToolSpec(tools, "named", named=name, parallel=par)
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", param="tool_choice")


def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_', '-' or '.'",
                          param=f"{where}.function.name")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad_request(f"'{where}.function.parameters' must be a JSON schema object",
                          param=f"{where}.function.parameters")
    out = {"name": name, "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


# -- output ------------------------------------------------------------------------------------------------------


def _value(raw: str, schema: dict[str, Any]) -> Any:
    text = raw.strip(_WS)
    types = schema.get("type")
    if types == "string" or (isinstance(types, list) and "string" in types and not _is_json(text)):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call(name: str, body: str, spec: ToolSpec) -> dict[str, Any]:
    props = spec.parameters(name).get("properties") or {}
    args = {k: _value(v, props.get(k) or {}) for k, v in _PARAM.findall(body)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_output(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output. Content: the text before the first call (None when empty);
    required / named: None (the constraint allows no text). Incomplete calls stay text."""
    calls = [_call(m.group(1).strip(), m.group(2), spec) for m in _CALL.finditer(text)]
    if not calls:
        return text, []
    before = text[: text.index(CALL_START)]
    content = None if spec.constrained or not before.strip(_WS) else before
    return content, calls


class ToolStream:
    """Splits one choice's streamed text into content deltas and whole tool calls: text is passed on until a
    `<tool_call>` may be starting, then held until a call closes (emitted as one `tool_calls` delta with its
    complete arguments; a malformed call held before it is dropped, as `parse_output` drops it) or the output ends
    (flushed as text when no call came)."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self._held = ""
        self.num_calls = 0
        self._seen_call = False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        buf = self._held + text
        out, calls = [], []
        while buf:
            m = _CALL.search(buf)
            start = buf.find(CALL_START)
            if m is not None:  # a whole call (text from `start` up to it is a malformed one: dropped, as parse_output)
                if not self._seen_call:
                    out.append(buf[:start])
                calls.append(_call(m.group(1).strip(), m.group(2), self.spec))
                self._seen_call = True
                buf = buf[m.end():]
                continue
            if start >= 0:
                if not self._seen_call:
                    out.append(buf[:start])
                buf = buf[start:]
                break
            keep = _partial_prefix(buf)
            if not self._seen_call:
                out.append(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep:]
            break
        self._held = buf
        if final:
            if not self._seen_call and not self.spec.constrained:
                out.append(self._held)
            self._held = ""
        for c in calls:
            c["index"] = self.num_calls
            self.num_calls += 1
        content = "".join(out)
        return (content if not self.spec.constrained else ""), calls


def _partial_prefix(text: str) -> int:
    """Length of the longest suffix of `text` that could begin `<tool_call>`."""
    for k in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-k:]):
            return k
    return 0


def history_message(m: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant message's `tool_calls` as chat templates expect them (arguments as an object, as vLLM passes
    them), or a `tool` message's fields; 400 on a malformed one."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(f"'{where}.tool_calls' must be a list on an assistant message",
                              param=f"{where}.tool_calls")
        rendered = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"'{where}.tool_calls[{j}].function.name' is required",
                                  param=f"{where}.tool_calls[{j}]")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except ValueError:
                    raise bad_request(f"'{where}.tool_calls[{j}].function.arguments' is not valid JSON",
                                      param=f"{where}.tool_calls[{j}].function.arguments") from None
            rendered.append({"id": c.get("id"), "type": "function",
                             "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = rendered
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


__all__ = ["TOOL_FORMAT", "ToolSpec", "ToolStream", "history_message", "parse_output", "parse_tools"]
