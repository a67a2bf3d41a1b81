"""Structured-output specs the workers would take long to compile: refused with a 400 naming the field.

xgrammar's compile time grows steeply with a JSON schema's nesting (about 8 times per doubling of depth: a chain of
128 nested objects takes about 0.4 s, 256 about 3 s, 900 half a minute) and with a regex's length, and a compile
holds one of a worker's few compile threads, so other structured requests queue behind it. `RequestLimits`
caps the nesting depth of each JSON schema (`response_format`, `structured_outputs.json`, `guided_json`, each
tool's `parameters`: JSON containers, so one object property costs two levels) and the length of a regex or
grammar. Checked on the raw body, before the request schema walks it; anything malformed is left to that schema.
Width costs too, within one object: an object of many optional properties (not in its `required`) compiled for
minutes (1,000: 0.55 s, 1,500: 1.6 s, 5,000: 384 s on one core; 5,000 required ones: 1.2 s), so the optional
properties of any one object are capped; the properties of a field's schemas in all (a request's tools together:
they compile into one grammar) are capped at 8 times that.
"""

from __future__ import annotations

import json
from typing import Any

from hybridpd.proxy.config import RequestLimits
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


def schema_properties(value: Any, cap: int) -> tuple[int, int]:
    """(the most optional properties of one object, the properties of all objects) declared by `properties`
    objects anywhere in `value`; stops once the total passes 8 x `cap`."""
    widest = total = 0
    stack: list[Any] = [value]
    while stack and total <= 8 * cap:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                required = node.get("required")
                names = set(required) & set(props) if isinstance(required, list) and all(
                    isinstance(r, str) for r in required) else set()
                widest, total = max(widest, len(props) - len(names)), total + len(props)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return widest, total


def check_structured_limits(body: dict[str, Any], limits: RequestLimits) -> None:
    """400 ApiError (code `limit_exceeded`) for a schema deeper than `max_schema_depth`, an object with more than
    `max_schema_properties` optional properties, more than 8 times that many properties in a field's schemas (a
    request's tools together), or a regex / grammar longer than `max_grammar_chars`."""
    max_depth, max_properties, max_chars = limits.max_schema_depth, limits.max_schema_properties, \
        limits.max_grammar_chars
    declared: dict[str, int] = {}
    for param, schema in _schemas(body):
        schema = _check_depth(param, schema, max_depth)
        widest, total = schema_properties(schema, max_properties)
        declared[param] = declared.get(param, 0) + total
        if widest > max_properties or declared[param] > 8 * max_properties:
            many = f"an object with more than {max_properties} optional" if widest > max_properties else \
                f"more than {8 * max_properties}"
            raise bad_request(f"'{param}' declares {many} JSON schema properties", param=param,
                              code="limit_exceeded")
    for param, text in _grammars(body):
        if len(text) > max_chars:
            raise bad_request(
                f"'{param}' holds a regex or grammar of {len(text)} characters; at most {max_chars}",
                param=param,
                code="limit_exceeded",
            )


def _check_depth(param: str, schema: Any, cap: int) -> Any:
    """The schema (parsed, when given as JSON text; None when that text is not JSON: the request schema says so)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise _too_deep(param, cap) from None
        except ValueError:
            return None
    if json_depth(schema, cap) > cap:
        raise _too_deep(param, cap)
    return schema


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
