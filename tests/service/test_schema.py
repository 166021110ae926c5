"""The JSON Schema subset a strict tool's parameters are checked against (muser_cli/service/schema.py),
and a strict tool's call refused by its schema in the tool-call parser (tools.ToolStream)."""

from __future__ import annotations

import json

import pytest

from muser_cli.service.schema import instance_problem, schema_problem
from muser_cli.service.tools import HERMES, ToolStream

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "minLength": 1, "title": "City"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"anyOf": [{"enum": ["C", "F"]}, {"type": "null"}]},
                          "spots": {"type": "array", "items": {"$ref": "#/$defs/spot"}, "maxItems": 2}},
           "$defs": {"spot": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}


@pytest.mark.parametrize("value, problem", [
    ({"city": "Paris", "days": 2}, None),
    ({"city": "Paris", "days": 2.0, "unit": None, "spots": [{"lat": 48.8}]}, None),
    ({"city": "Paris", "days": 2, "unit": "F"}, None),
    ({"city": "Paris"}, "the required property 'days' is missing"),
    ({"city": "Paris", "days": True}, "days is boolean, not integer"),
    ({"city": "Paris", "days": 9}, "days breaks its maximum 7"),
    ({"city": "", "days": 1}, "city has 0 characters"),
    ({"city": "Paris", "days": 1, "unit": "K"}, "unit matches none of anyOf's schemas"),
    ({"city": "Paris", "days": 1, "wind": 3}, "the property 'wind' is not allowed"),
    ({"city": "Paris", "days": 1, "spots": [{"lon": 2}]}, "the required property 'lat' is missing"),
    ({"city": "Paris", "days": 1, "spots": [{"lat": 1}] * 3}, "has 3 items"),
])
def test_arguments_are_checked_against_the_schema(value, problem):
    assert schema_problem(WEATHER) is None
    got = instance_problem(value, WEATHER)
    assert (got is None) if problem is None else (problem in (got or "")), got


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "patternProperties": {}}, "does not check the keyword 'patternProperties'"),
    ({"type": "object", "properties": {"a": {"type": "str"}}}, "properties.a.type must be one of"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}, "does not point inside"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}, "not a regular expression"),
    ({"type": "object", "required": "a"}, "required must be a list"),
])
def test_a_schema_outside_what_is_checked_is_named(schema, words):
    assert words in (schema_problem(schema) or "")


def test_a_strict_tools_call_that_its_schema_refuses_fails_the_answer():
    schema = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"],
              "additionalProperties": False}
    good = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
    ok = ToolStream(HERMES, ("get_time",), strict={"get_time": schema})
    events = ok.feed(good) + ok.finish()
    assert ok.error is None and [json.loads(p["arguments"]) for k, p in events if k == "call"] == [{"tz": "CET"}]
    refused = ToolStream(HERMES, ("get_time",), strict={"get_time": schema})
    events = refused.feed(bad) + refused.finish()
    assert refused.calls == [] and events == [] and refused.error is not None
    assert refused.error.code == "tool_call_failed" and "'tz' is missing" in refused.error.message
    loose = ToolStream(HERMES, ("get_time",))  # not strict: the same call is returned as the model wrote it
    assert [k for k, _ in loose.feed(bad) + loose.finish()] == ["call"] and loose.error is None
