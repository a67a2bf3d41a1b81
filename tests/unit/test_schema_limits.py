"""Structured-output specs too deep or too long to compile cheaply: a 400 naming the field, before any worker."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hybridpd.proxy.config import RequestLimits
from hybridpd.proxy.errors import ApiError
from hybridpd.proxy.request_limits import check_body_limits
from hybridpd.proxy.schema_limits import json_depth, schema_properties

LIMITS = RequestLimits(max_schema_depth=8, max_grammar_chars=16, max_schema_properties=6)


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def _tools(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _bodies(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    return [
        (
            "response_format",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
        ),
        ("structured_outputs", {"structured_outputs": {"json": schema}}),
        ("structured_outputs", {"structured_outputs": {"json": json.dumps(schema)}}),
        ("guided_json", {"guided_json": schema}),
        ("guided_json", {"guided_json": json.dumps(schema)}),
        ("tools", {"tools": _tools(schema)}),
    ]


def test_json_depth_counts_containers() -> None:
    assert [json_depth(v, 99) for v in ("s", {}, [1], {"a": [{"b": 1}]})] == [0, 1, 1, 3]
    assert json_depth(_nested(7), 99) == 8
    assert json_depth(_nested(500), 10) == 11  # stops one past the cap: no walk of a hostile document


def test_schemas_up_to_the_cap_pass() -> None:
    for _, body in _bodies(_nested(7)):  # 8 levels of containers
        check_body_limits(body, LIMITS)


@pytest.mark.parametrize("levels", [8, 900])
def test_deeper_schemas_are_a_400_naming_the_field(levels: int) -> None:
    for param, body in _bodies(_nested(levels)):
        with pytest.raises(ApiError) as info:
            check_body_limits(body, LIMITS)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, "limit_exceeded")
        assert "nesting depth" in info.value.message and "8" in info.value.message


def test_regex_and_grammar_length() -> None:
    ok = "a" * 16
    for body in ({"structured_outputs": {"regex": ok}}, {"guided_grammar": ok}, {"guided_regex": ok}):
        check_body_limits(body, LIMITS)
    for param, body in (
        ("structured_outputs", {"structured_outputs": {"regex": ok + "b"}}),
        ("structured_outputs", {"structured_outputs": {"grammar": ok + "b"}}),
        ("guided_regex", {"guided_regex": ok + "b"}),
        ("guided_grammar", {"guided_grammar": ok + "b"}),
    ):
        with pytest.raises(ApiError) as info:
            check_body_limits(body, LIMITS)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, "limit_exceeded")


def test_malformed_specs_are_left_to_the_schema() -> None:
    for body in (
        {"response_format": "x"},
        {"structured_outputs": 3},
        {"guided_json": "{not json"},
        {"tools": "x"},
        {"tools": [1, {"function": 2}]},
        {"guided_regex": 5},
    ):
        check_body_limits(body, LIMITS)


def _wide(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def test_schema_properties_are_counted_everywhere() -> None:
    nested = {"type": "object", "properties": {"a": _wide(2), "b": {"type": "array", "items": _wide(3)}},
              "required": ["a", "b"]}
    assert schema_properties(nested, 99) == (3, 2 + 2 + 3)
    assert schema_properties({"anyOf": [_wide(4), _wide(5)]}, 99) == (5, 9)
    assert schema_properties({**_wide(5), "required": ["p0", "p1", "zz"]}, 99) == (3, 5)
    assert schema_properties(_wide(10_000), 6) == (10_000, 10_000)  # one object whole, then the walk stops


def test_objects_with_too_many_optional_properties_are_a_400_naming_the_field() -> None:
    for _, body in _bodies(_wide(6)):
        check_body_limits(body, LIMITS)
    required = {**_wide(40), "required": [f"p{i}" for i in range(40)]}  # required ones are cheap: only the total
    for _, body in _bodies(required):
        check_body_limits(body, LIMITS)
    for param, body in _bodies(_wide(7)):
        with pytest.raises(ApiError) as info:
            check_body_limits(body, LIMITS)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, "limit_exceeded")
        assert "more than 6 optional" in info.value.message


def test_a_fields_schemas_count_together() -> None:
    tools = _tools({"anyOf": [_wide(5)] * 5}) + _tools({"anyOf": [_wide(5)] * 5})  # 50 > 8 x 6 in one grammar
    with pytest.raises(ApiError) as info:
        check_body_limits({"tools": tools}, LIMITS)
    assert info.value.param == "tools" and "more than 48" in info.value.message
    check_body_limits({"tools": _tools({"anyOf": [_wide(5)] * 5}) * 1}, LIMITS)
