"""``strict: true`` closes the objects a schema leaves open (strict_schema.py): where that only
removes instances, never where it could refuse what the request's schema asks for or let in
what it refuses; and from the API, a strict request's schema and a strict tool's parameters are
closed while a request without ``strict`` keeps JSON Schema's open objects."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from bench.jsonschemabench import load_rows
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.serving import _structured_outputs_from
from kvscale.server.entrypoints.serving_tools import plan_tools
from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import backend
from kvscale.server.structured_outputs.compiler import cache_key
from kvscale.server.structured_outputs.strict_schema import close_objects

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}}


def closed_at(schema: Any) -> list[str]:
    """JSON pointers of the nodes that carry ``additionalProperties: false``."""
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if node.get("additionalProperties") is False:
                found.append(path or "/")
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(schema, "")
    return sorted(found)


def test_open_objects_are_closed_at_every_level_and_the_request_schema_is_not_changed() -> None:
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}},
    }}
    before = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert schema == before
    assert closed_at(closed) == ["/", "/properties/a", "/properties/list/items"]
    assert jsonschema.Draft202012Validator(closed).is_valid({"a": {"b": "x"}, "list": [{"c": 1}]})
    assert not jsonschema.Draft202012Validator(closed).is_valid({"a": {"b": "x"}, "z": 1})
    assert not jsonschema.Draft202012Validator(closed).is_valid({"a": {"b": "x", "z": 1}})


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": {"type": "string"}},
    {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},  # b is only required
    {"type": "object", "properties": {"a": {}}, "minProperties": 2},
    {"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}},
    {"type": "object", "properties": {"a": {}}, "enum": [{"a": 1, "b": 2}]},
    {"type": "object", "properties": {"a": {}}, "const": {"a": 1, "b": 2}},
    {"type": "object"},  # any object: nothing is listed, so nothing could be closed to
    True,
], ids=["additional-true", "additional-schema", "pattern", "unevaluated", "required-unlisted", "min-properties",
        "dependent-required-unlisted", "enum", "const", "no-properties", "boolean"])
def test_a_schema_that_says_what_else_an_object_holds_or_needs_more_is_left_open(schema: Any) -> None:
    assert close_objects(schema) is schema


def test_parts_joined_by_all_of_stay_open_but_the_objects_inside_their_properties_close() -> None:
    # Closing either part would refuse the key the other lists: {"a": 1, "b": 2} is valid.
    schema = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {"type": "object", "properties": {"c": {}}}}}]}
    closed = close_objects(schema)
    assert closed_at(closed) == ["/allOf/1/properties/b"]
    assert jsonschema.Draft202012Validator(closed).is_valid({"a": 1, "b": {"c": 2}})


def test_any_of_branches_close_unless_their_parent_lists_properties_of_its_own() -> None:
    alone = {"anyOf": [{"properties": {"a": {}}, "required": ["a"]}, {"properties": {"b": {}}, "required": ["b"]}]}
    assert closed_at(close_objects(alone)) == ["/anyOf/0", "/anyOf/1"]
    beside = {"properties": {"p": {}}, "anyOf": alone["anyOf"]}
    assert close_objects(beside) is beside  # {"p": 1, "a": 2} is valid: the branch must not refuse p


def test_a_reference_target_closes_only_where_every_use_of_it_stands_alone() -> None:
    target = {"type": "object", "properties": {"x": {}}}
    alone = {"properties": {"one": {"$ref": "#/$defs/t"}, "two": {"$ref": "#/$defs/t"}}, "$defs": {"t": target}}
    assert closed_at(close_objects(alone)) == ["/", "/$defs/t"]
    joined = {"properties": {"one": {"$ref": "#/$defs/t"}, "two": {"allOf": [{"$ref": "#/$defs/t"},
                                                                               {"properties": {"y": {}}}]}},
              "$defs": {"t": target}}
    closed = close_objects(joined)
    assert closed_at(closed) == ["/"]
    assert jsonschema.Draft202012Validator(closed).is_valid({"two": {"x": 1, "y": 2}})


@pytest.mark.parametrize("keyword", ["oneOf", "not", "if", "contains", "propertyNames"])
def test_nothing_closes_where_a_narrower_schema_could_let_more_through(keyword: str) -> None:
    part = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    schema = {keyword: [part, {"properties": {"c": {}}}]} if keyword == "oneOf" else {keyword: part}
    assert close_objects(schema) is schema


def test_one_of_is_why_those_places_stay_open() -> None:
    """{"a": 1} matches both open branches, so oneOf refuses it; with the branches closed it would
    match only the first: a closed oneOf accepts an instance the request's schema refuses."""
    schema = {"oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert not jsonschema.Draft202012Validator(schema).is_valid({"a": 1})
    wrongly = {"oneOf": [{**branch, "additionalProperties": False} for branch in schema["oneOf"]]}
    assert jsonschema.Draft202012Validator(wrongly).is_valid({"a": 1})
    assert close_objects(schema) is schema


@pytest.mark.parametrize("schema", [
    {"properties": {"a": {"$ref": "https://example.com/a.json"}}},
    {"properties": {"a": {"$ref": "#anchor"}}, "$defs": {"x": {"$anchor": "anchor"}}},
    {"properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"properties": {"a": {"$id": "https://example.com/a", "properties": {"b": {}}}}},
], ids=["remote", "anchor", "missing", "nested-id"])
def test_a_schema_whose_references_are_not_all_local_pointers_is_left_as_it_is(schema: Any) -> None:
    assert close_objects(schema) is schema


def _with_extra_keys(instance: Any) -> Any:
    if isinstance(instance, dict):
        return {**{key: _with_extra_keys(value) for key, value in instance.items()}, "zz_extra": 1}
    if isinstance(instance, list):
        return [_with_extra_keys(item) for item in instance]
    return instance


def test_on_the_shared_sample_the_closed_schema_only_removes_instances_and_compiles_where_the_schema_did() -> None:
    """Every test instance of the sample (and each with an unlisted key added to all its objects)
    that a closed schema accepts, the request's schema accepts; a schema the library enforced
    is still enforced once closed."""
    changed = 0
    for row in load_rows():
        schema = row["schema"]
        closed = close_objects(schema)
        if closed is schema:
            continue
        changed += 1
        original_validator = jsonschema.validators.validator_for(schema)(schema)
        closed_validator = jsonschema.validators.validator_for(schema)(closed)
        for test in row.get("tests", []):
            for instance in (test["data"], _with_extra_keys(test["data"])):
                if closed_validator.is_valid(instance):
                    assert original_validator.is_valid(instance), (row["id"], json.dumps(instance)[:200])
        if backend.schema_refusal(schema) is None:
            assert backend.schema_refusal(closed) is None, row["id"]
    assert changed >= 100  # most of the sample's schemas leave an object open


def test_a_strict_response_format_is_closed_by_the_compile_and_one_without_strict_is_not() -> None:
    """The HTTP side hands the schema on as sent, with the flag (walking a large schema there
    stalled every stream the event loop serves); the grammar the compile worker builds from it
    is the closed schema's, and the compile cache tells the two apart."""
    def constraint(strict: bool | None) -> StructuredOutputsParams:
        fmt: dict[str, Any] = {"name": "answer", "schema": OPEN}
        if strict is not None:
            fmt["strict"] = strict
        body = p.ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": fmt}})
        params, field = _structured_outputs_from(body)
        assert params is not None and field == "response_format" and params.json is not None
        assert json.loads(params.json) == OPEN
        return params

    strict, lax, unset = constraint(True), constraint(False), constraint(None)
    assert (strict.disable_additional_properties, lax.disable_additional_properties,
            unset.disable_additional_properties) == (True, False, False)
    assert backend.library_schema(strict.json, close=True) == {**OPEN, "additionalProperties": False}
    assert backend.library_schema(lax.json) == lax.json
    assert backend.grammar_text(strict) == backend.grammar_text(
        StructuredOutputsParams(json=json.dumps({**OPEN, "additionalProperties": False})))
    assert backend.grammar_text(lax) != backend.grammar_text(strict)
    assert cache_key(strict) != cache_key(lax) == cache_key(unset)
    with pytest.raises(ValueError, match="disable_additional_properties"):
        StructuredOutputsParams(regex="a+", disable_additional_properties=True)


def test_a_strict_tool_has_its_parameters_closed() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": OPEN, "strict": True}},
             {"type": "function", "function": {"name": "g", "parameters": OPEN}}]
    body = p.ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"})
    plan = plan_tools(body, parser="hermes", auto_enabled=True)
    assert plan.constraint is not None and plan.constraint.grammar is not None
    grammar = plan.constraint.grammar
    assert json.dumps({**OPEN, "additionalProperties": False})[:-1] in grammar  # f's arguments
    assert '"properties": {"a": {"type": "integer"}}, "x-guidance"' in grammar  # g's, open
