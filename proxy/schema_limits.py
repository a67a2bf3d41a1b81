"""Structured-output specs the workers would take long to compile: refused with a 400 naming the field.

xgrammar's compile time grows steeply with a JSON schema's nesting (about 8 times per doubling of depth: a chain of
128 nested objects takes about 0.4 s, 256 about 3 s, 900 half a minute) and with a regex's length, and a compile
holds one of a worker's few compile threads, so other structured requests queue behind it. `RequestLimits`
caps the nesting depth of each JSON schema (`response_format`, `structured_outputs.json`, `guided_json`, each
tool's `parameters`: JSON containers, so one object property costs two levels) and the length of a regex or
grammar. Checked on the raw body, before the request schema walks it; anything malformed is left to that schema.
"""

from __future__ import annotations

import json
from typing import Any

from hybridpd.proxy.errors import ApiError, bad_request


def json_depth(value: Any, cap: int) -> int:
    """Nesting depth of JSON containers in `value` (a scalar: 0); stops at cap + 1 without walking further."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        depth += 1
        if depth > cap:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_structured_limits(body: dict[str, Any], max_depth: int, max_chars: int) -> None:
    """400 ApiError (code `limit_exceeded`) for a schema deeper than `max_depth` or a regex / grammar longer than
    `max_chars`."""
    for param, schema in _schemas(body):
        _check_depth(param, schema, max_depth)
    for param, text in _grammars(body):
        if len(text) > max_chars:
            raise bad_request(
                f"'{param}' holds a regex or grammar of {len(text)} characters; at most {max_chars}",
                param=param,
                code="limit_exceeded",
            )


def _check_depth(param: str, schema: Any, cap: int) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise _too_deep(param, cap) from None
        except ValueError:
            return  # not JSON: the request schema says so
    if json_depth(schema, cap) > cap:
        raise _too_deep(param, cap)


def _too_deep(param: str, cap: int) -> ApiError:
    return bad_request(
        f"'{param}' holds a JSON schema whose nesting depth exceeds {cap}", param=param, code="limit_exceeded"
    )


def _schemas(body: dict[str, Any]) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    rf = body.get("response_format")
    if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict):
        js = rf["json_schema"]
        found.append(("response_format", js.get("schema", js.get("json_schema"))))
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        found.append(("structured_outputs", so.get("json")))
    found.append(("guided_json", body.get("guided_json")))
    tools = body.get("tools")
    if isinstance(tools, list):
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(fn, dict):
                found.append(("tools", fn.get("parameters")))
    return [(p, s) for p, s in found if s is not None]


def _grammars(body: dict[str, Any]) -> list[tuple[str, str]]:
    so = body.get("structured_outputs")
    found = [("structured_outputs", so.get(k)) for k in ("regex", "grammar")] if isinstance(so, dict) else []
    found += [(f"guided_{k}", body.get(f"guided_{k}")) for k in ("regex", "grammar")]
    return [(p, t) for p, t in found if isinstance(t, str)]
