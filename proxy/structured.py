"""Structured-output request fields -> one `(kind, spec)` pair for the workers (engine.structured.spec).

Accepted spellings (vLLM's OpenAI server): `response_format` {"type": "text" | "json_object" | "json_schema",
"json_schema": {"name", "schema", "strict"}}; `structured_outputs` {"json" | "regex" | "choice" | "grammar" |
"json_object"} (exactly one); the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most
one constraint per request. Checked here: shapes (a schema is an object, a regex or grammar a non-empty string, a
choice a non-empty list of non-empty strings). Compiling needs the model's tokenizer and xgrammar (which imports
torch), so it happens on the first worker: a malformed schema, regex or grammar comes back as a 400 naming the
problem from there.
"""

from __future__ import annotations

import json
from typing import Any

from hybridpd.proxy.errors import bad_request

Structured = tuple[str, str]
_IGNORED_OPTIONS = frozenset({"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                              "whitespace_pattern"})


def parse_structured(body: dict[str, Any]) -> Structured | None:
    """The request's structured-output constraint, or None. 400 on a malformed or doubled one."""
    found: list[tuple[str, Structured]] = []
    rf = body.get("response_format")
    if rf is not None:
        got = _response_format(rf)
        if got is not None:
            found.append(("response_format", got))
    so = body.get("structured_outputs")
    if so is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    for kind in ("json", "regex", "choice", "grammar"):
        v = body.get(f"guided_{kind}")
        if v is not None:
            found.append((f"guided_{kind}", _one(kind, v, f"guided_{kind}")))
    if len(found) > 1:
        names = ", ".join(f"'{n}'" for n, _ in found)
        raise bad_request(f"only one structured output constraint per request, got {names}", param=found[1][0])
    return found[0][1] if found else None


def _response_format(rf: Any) -> Structured | None:
    if not isinstance(rf, dict):
        raise bad_request("'response_format' must be an object", param="response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("'response_format.json_schema' must be an object with a 'schema'",
                              param="response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise bad_request("'response_format.json_schema.schema' is required", param="response_format.json_schema")
        return _one("json", schema, "response_format.json_schema.schema")
    raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got "
                      f"{str(kind)[:40]!r}", param="response_format.type")


def _structured_outputs(so: Any) -> Structured:
    if not isinstance(so, dict):
        raise bad_request("'structured_outputs' must be an object", param="structured_outputs")
    unknown = sorted(k for k in so if k not in ("json", "regex", "choice", "grammar", "json_object")
                     and k not in _IGNORED_OPTIONS)
    if unknown:
        raise bad_request(f"'structured_outputs.{unknown[0]}' is not supported (use json, regex, choice, grammar or "
                          "json_object)", param=f"structured_outputs.{unknown[0]}", code="unsupported_parameter")
    given = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
    if so.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise bad_request("'structured_outputs' needs exactly one of json, regex, choice, grammar, json_object; got "
                          f"{given or 'none'}", param="structured_outputs")
    kind = given[0]
    if kind == "json_object":
        return ("json_object", "")
    return _one(kind, so[kind], f"structured_outputs.{kind}")


def _one(kind: str, v: Any, name: str) -> Structured:
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise bad_request(f"'{name}' is not valid JSON: {e}", param=name) from None
        if not isinstance(v, dict | bool):
            raise bad_request(f"'{name}' must be a JSON schema object", param=name)
        return ("json", json.dumps(v))
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad_request(f"'{name}' must be a non-empty list of non-empty strings", param=name)
        return ("choice", json.dumps(v))
    if not isinstance(v, str) or not v:
        raise bad_request(f"'{name}' must be a non-empty string", param=name)
    return (kind, v)


__all__ = ["Structured", "parse_structured"]
