"""The exact rewrites of refused keywords (schema_rewrites.py): each rewritten schema judges many
instances, edge cases included, exactly as the original does under the ``jsonschema`` library, and
so does the grammar compiled from it; unproven cases keep their 400 naming the keyword; and on
the shared sample, the schemas that compile only since the rewrites judge every test instance
right."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import jsonschema
import llguidance
import pytest

from bench.json_key_order import accepts_text, compact, judged_valid
from bench.jsonschemabench import load_rows
from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs import backend
from kvscale.server.structured_outputs.schema_rewrites import rewrite_schema

VOCAB = 49152
EOS = {0, 2}
DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"
NON_OBJECTS: list[Any] = [None, True, 0, 1.5, "a", [], [1, "b"]]


@pytest.fixture(scope="module")
def lltokenizer(bundled_tokenizer):
    return backend.build_tokenizer(bundled_tokenizer, VOCAB, EOS)


@pytest.fixture(scope="module")
def judge(lltokenizer, bundled_tokenizer):
    """judge(schema, instances, validator): every instance is judged by the rewritten schema and
    by the grammar compiled from it as ``validator`` judges it by the original schema."""

    def encode(text: str) -> list[int]:
        return bundled_tokenizer(text, add_special_tokens=False)["input_ids"]

    def check(schema: Any, instances: list[Any], validator: Any = jsonschema.Draft7Validator) -> Any:
        rewritten = rewrite_schema(schema)
        compiled = backend.compile_grammar(
            lltokenizer, backend.grammar_text(StructuredOutputsParams(json=json.dumps(schema))))
        wrong = []
        for instance in instances:
            valid = validator(schema).is_valid(instance)
            if validator(rewritten).is_valid(instance) != valid:
                wrong.append(("rewritten schema", instance, valid))
            if not judged_valid(compiled, encode, instance, rewritten, valid):
                wrong.append(("grammar", instance, valid))
        assert not wrong, wrong
        return rewritten

    return check


def objects_over(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object made of a subset of ``values``' entries (keys in the dict's order)."""
    return [{key: values[key] for key in keys}
            for n in range(len(values) + 1) for keys in itertools.combinations(values, n)]


# --- dependencies ---------------------------------------------------------------------------
def test_property_dependencies_hold_only_when_the_key_is_there_and_only_for_objects(judge):
    schema = {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "additionalProperties": False,
              "dependencies": {"a": ["b"], "b": []}}
    rewritten = judge(schema, objects_over({"a": 1, "b": "x", "c": None}) + NON_OBJECTS + [{"a": "x", "b": "y"}])
    assert "dependencies" not in json.dumps(rewritten)


def test_a_dependency_beside_other_combinators_is_one_more_conjunct(judge):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {}},
              "additionalProperties": False, "anyOf": [{"required": ["c"]}, {"required": ["b"]}],
              "allOf": [{"required": ["b"]}], "dependencies": {"a": ["b", "c"], "c": ["a"]}}
    judge(schema, objects_over({"a": 1, "b": "x", "c": None, "d": 0}) + NON_OBJECTS)


def test_a_schema_dependency_applies_its_schema_to_the_whole_instance(judge):
    """The dependency's own additionalProperties sees only its own properties, not the node's."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}},
              "dependencies": {"a": {"properties": {"b": {"type": "string"}}, "additionalProperties": False},
                               "b": True, "z": False}}
    judge(schema, objects_over({"a": 1, "b": "x", "z": 0}) + [{"a": 1, "b": 2}, {"b": 2}] + NON_OBJECTS)


def test_dependent_required_and_dependent_schemas_of_2019_and_later(judge):
    schema = {"$schema": DRAFT_2020, "type": "object",
              "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
              "dependentRequired": {"a": ["b"]},
              "dependentSchemas": {"b": {"properties": {"c": {"const": True}}, "required": ["c"]}}}
    judge(schema, objects_over({"a": 1, "b": "x", "c": True}) + [{"b": "x", "c": False}] + NON_OBJECTS,
          jsonschema.Draft202012Validator)


def test_each_draft_keeps_the_spelling_it_does_not_define_as_it_is():
    """``dependencies`` is no keyword in 2020-12 (nor ``dependentRequired`` in draft-07): neither
    is enforced there nor rewritten, so the library's refusal stays."""
    in_2020 = {"$schema": DRAFT_2020, "dependencies": {"a": ["b"]}}
    in_07 = {"$schema": "http://json-schema.org/draft-07/schema#", "dependentRequired": {"a": ["b"]}}
    assert rewrite_schema(in_2020) == in_2020 and rewrite_schema(in_07) == in_07
    assert "dependencies" in (backend.schema_refusal(in_2020) or "")


# --- oneOf ----------------------------------------------------------------------------------
def test_one_of_with_disjoint_types_becomes_any_of(judge):
    schema = {"definitions": {"obj": {"type": "object", "properties": {"x": {"type": "integer"}}}},
              "type": "object", "properties": {
                  "v": {"oneOf": [{"$ref": "#/definitions/obj"}, {"type": "null"}, {"type": ["string", "boolean"]}]},
                  "w": {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}}}
    instances = [{"v": value} for value in [{"x": 1}, {"x": "s"}, None, "s", True, 1]]
    instances += [{"w": value} for value in [1, 1.5, "s", [1], ["s"], None]]
    rewritten = judge(schema, instances)
    assert "oneOf" not in json.dumps(rewritten)


def test_one_of_told_apart_by_a_required_property_becomes_any_of(judge):
    schema = {"definitions": {
        "site": {"type": "object", "properties": {"type": {"enum": ["site"]}, "name": {"type": "string"}},
                 "required": ["type"], "additionalProperties": False},
        "ref": {"type": "object", "properties": {"type": {"const": "reference"}, "name": {}},
                "required": ["type", "name"]}},
        "oneOf": [{"$ref": "#/definitions/site"}, {"allOf": [{"$ref": "#/definitions/ref"}, {"properties": {"id": {}}}]},
                  {"type": "object", "properties": {"type": {"type": "integer"}}, "required": ["type"]},
                  {"const": 0, "standsFor": False}, {"enum": [1, "one"]}, {"const": True}]}
    instances = [{"type": "site"}, {"type": "site", "name": "n"}, {"type": "reference", "name": 1},
                 {"type": "reference"}, {"type": 3}, {"type": "other"}, {}, 0, 1, "one", 2, None, True, False]
    rewritten = judge(schema, instances)
    assert "oneOf" not in json.dumps(rewritten)


def test_one_of_of_branches_that_constrain_only_objects_is_an_object_matching_one(judge):
    """Every non-object matches every such branch, so oneOf rejects it; among objects the
    branches are told apart by a required key's value, or by a key the other cannot have, or
    within the node's own type."""
    schema = {"definitions": {
        "closed": {"properties": {"b": {}, "c": {}}, "additionalProperties": False, "title": "t"}},
        "type": "object", "properties": {
            "kv": {"oneOf": [{"properties": {"k": {"const": 1}}, "required": ["k"]},
                             {"properties": {"k": {"enum": [2, 3]}}, "required": ["k"]}]},
            "keys": {"oneOf": [{"required": ["a"]}, {"$ref": "#/definitions/closed"}]},
            # Strings would match both branches, but the node's own type lets none through.
            "typed": {"type": "object", "oneOf": [
                {"type": ["object", "string"], "properties": {"k": {"const": 1}}, "required": ["k"]},
                {"type": ["object", "string"], "properties": {"k": {"const": 2}}, "required": ["k"]}]}}}
    values = NON_OBJECTS + [{}, {"k": 1}, {"k": 2}, {"k": 4}, {"a": 0}, {"b": 0}, {"a": 0, "b": 1}, {"c": 0, "b": 1}]
    instances = [{key: value} for key in schema["properties"] for value in values]
    rewritten = judge(schema, instances)
    assert "oneOf" not in json.dumps(rewritten)


@pytest.mark.parametrize("branches", [
    [{"type": "number"}, {"type": "integer"}],  # 1 is both
    [{"required": ["radius"]}, {"required": ["length", "width"]}],  # an object may have all three
    [{"type": "object", "properties": {"k": {"const": 1}}}, {"type": "object", "properties": {"k": {"const": 2}}}],  # k absent
    [{"properties": {"eq": {"type": "integer"}}}, {"properties": {"lt": {"type": "integer"}}}],  # {} is both
    # A short string matches the first only: not "an object, and one branch".
    [{"properties": {"k": {"const": 1}}, "required": ["k"]}, {"properties": {"k": {"const": 2}}, "required": ["k"], "minLength": 3}],
    [{"required": ["a"]}, {"properties": {"b": {}}, "additionalProperties": True}],  # {"a": 1} is both
    [{"type": "string"}, {"required": ["a"]}],  # a string matches both
    [{"type": ["object", "string"], "properties": {"k": {"const": 1}}, "required": ["k"]},
     {"type": ["object", "string"], "properties": {"k": {"const": 2}}, "required": ["k"]}],  # so does this one's
    [{"type": "string"}, {"$ref": "#/definitions/loop"}],  # a reference that never reaches a type
    [{"type": "string"}, {"$ref": "https://example.com/remote.json"}],
    [{"type": "any"}, {"type": "string"}],  # draft-03's any: not a type name the proof knows
    [{"const": 1}, {"const": 1.0}],  # one number
    [{"enum": [[1, {"a": None}], "x"]}, {"enum": [[1.0, {"a": None}]]}],  # one array
])
def test_one_of_that_is_not_proven_disjoint_stays_refused_naming_one_of(branches):
    schema = {"definitions": {"loop": {"$ref": "#/definitions/loop"}}, "oneOf": branches}
    assert rewrite_schema(schema) == schema
    # The library names the first thing it cannot do: the oneOf, or a branch it cannot read.
    refusal = backend.schema_refusal(schema) or ""
    assert any(word in refusal for word in ("oneOf", "remote.json", "Invalid type: any")), refusal


def test_references_are_not_followed_below_a_nested_id():
    """A "#/..." pointer is relative to the nearest enclosing $id: with one nested, the proof gives up."""
    schema = {"definitions": {"s": {"type": "string"}},
              "properties": {"p": {"$id": "https://example.com/p.json", "definitions": {"s": {"type": "null"}},
                                   "oneOf": [{"$ref": "#/definitions/s"}, {"type": "null"}]}}}
    assert rewrite_schema(schema) == schema


def test_one_of_cases_of_the_sample_that_overlap_stay_refused():
    """calculate_area's oneOf of required lists overlaps (an object may carry every key)."""
    row = next(row for row in load_rows() if row["id"] == "Glaiveai2K---calculate_area_69d66e10")
    assert "oneOf" in (backend.schema_refusal(row["schema"]) or "")


# --- not ------------------------------------------------------------------------------------
def test_simple_negations_become_types_and_absent_keys(judge):
    schema = {"type": "object", "properties": {
        "gone": {"not": {}}, "also_gone": {"description": "d", "not": True},
        "not_object": {"not": {"type": "object", "title": "t"}},
        "not_number": {"not": {"type": ["number", "null"]}},
        "one_missing": {"not": {"required": ["a", "b"]}},
        "always": {"not": False}, "none_required": {"not": {"required": []}},
        "nonempty": {"not": {"maxItems": 0}}, "short": {"not": {"minLength": 2}}, "any_string": {"not": {"minLength": 0}},
        "broken": {"not": {"properties": {"a": {"type": "number"}, "b": {"maxItems": 1}, "c": {}, "d": False},
                           "required": ["a"]}}}}
    values = [None, True, 0, 1.5, "s", "st", [], [1], [1, 2], {}, {"a": 1}, {"a": "x"}, {"a": 1, "b": 2},
              {"a": 1, "b": [1, 2]}, {"a": 1, "b": [1]}, {"a": 1, "c": 0}, {"a": 1, "d": 0}, {"b": 1, "c": 0}]
    instances = [{key: value} for key in schema["properties"] for value in values] + [{}]
    rewritten = judge(schema, instances)
    assert '"not"' not in json.dumps(rewritten)


@pytest.mark.parametrize("negated", [
    {"type": "integer"},  # 1.5 is not an integer: no list of types says "number but not integer"
    {"required": ["a"], "properties": {"a": {"enum": ["x"]}}},  # a value outside an enum: no form
    {"enum": [1, 2]},
    {"maxItems": 1, "minItems": 1},
])
def test_other_negations_stay_refused_naming_not(negated):
    schema = {"type": "object", "properties": {"p": {"not": negated}}}
    assert rewrite_schema(schema) == schema
    assert "not" in (backend.schema_refusal(schema) or "")


# --- propertyNames --------------------------------------------------------------------------
def test_property_names_that_every_string_passes_go(judge):
    """An object's keys are strings: a propertyNames every string passes asserts nothing."""
    schema = {"$schema": DRAFT_2020, "type": "object", "properties": {
        "env": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "string"}},
        "any": {"propertyNames": True}, "empty": {"propertyNames": {}},
        "listed": {"propertyNames": {"type": ["null", "string"], "title": "t", "description": "d"}}}}
    values = [*NON_OBJECTS, {}, {"a": "x"}, {"a": 1}, {"": "y", "b c": "z"}]
    instances = [{key: value} for key in schema["properties"] for value in values] + [{}]
    rewritten = judge(schema, instances, jsonschema.Draft202012Validator)
    assert "propertyNames" not in json.dumps(rewritten)
    assert backend.schema_refusal(schema) is None


@pytest.mark.parametrize("names", [{"pattern": "^a"}, {"maxLength": 3}, {"type": "integer"}, {"enum": ["a"]},
                                   {"type": "string", "minLength": 1}, {"type": "any"}, False])
def test_property_names_that_assert_something_stay_refused(names):
    schema = {"type": "object", "propertyNames": names}
    assert rewrite_schema(schema) == schema
    assert "propertyNames" in (backend.schema_refusal(schema) or "")


def test_a_property_names_a_reference_points_into_stays():
    schema = {"type": "object", "propertyNames": {"type": "string"},
              "properties": {"p": {"$ref": "#/propertyNames"}}}
    assert rewrite_schema(schema) == schema


# --- what is never touched ------------------------------------------------------------------
def test_nothing_beside_a_ref_and_no_data_is_rewritten():
    """Draft-07 ignores $ref's siblings: a conjunct added there would be a new constraint. Names
    of properties and the values of const / enum / default / examples are data, not keywords."""
    beside_ref = {"definitions": {"o": {"type": "object"}},
                  "properties": {"p": {"$ref": "#/definitions/o", "dependencies": {"a": ["b"]}}}}
    assert rewrite_schema(beside_ref) == beside_ref
    data = {"properties": {"oneOf": {"type": "string"}, "not": {"enum": [{"not": {}}]},
                           "dependencies": {"const": {"dependencies": {"a": ["b"]}},
                                            "default": {"oneOf": [1]}, "examples": [{"not": {}}]}}}
    assert rewrite_schema(data) == data


def test_the_rewrite_leaves_its_argument_untouched_and_refusals_name_what_is_left():
    schema = {"type": "object", "dependencies": {"a": ["b"]},
              "properties": {"n": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}}
    before = copy.deepcopy(schema)
    rewrite_schema(schema)
    assert schema == before
    assert "oneOf" in (backend.schema_refusal(schema) or "")


# --- the shared sample ----------------------------------------------------------------------
def library_refusal(schema: Any) -> str | None:
    """The library's verdict on the schema as written, without kvscale's rewrites."""
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=backend.JSON_OPTIONS)
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(text, None) or None


def test_sample_schemas_that_compile_only_since_the_rewrites_judge_every_test_instance_right(
        lltokenizer, bundled_tokenizer):
    """A wrong rewrite accepts an invalid test instance or rejects a valid one."""

    def encode(text: str) -> list[int]:
        return bundled_tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = load_rows()
    gained = [row for row in rows if library_refusal(row["schema"]) and backend.schema_refusal(row["schema"]) is None]
    assert len(gained) >= 13, [row["id"] for row in gained]
    checked = 0
    wrong: list[str] = []
    for row in gained:
        compiled = backend.compile_grammar(
            lltokenizer, backend.grammar_text(StructuredOutputsParams(json=compact(row["schema"]))))
        for test in row.get("tests") or []:
            checked += 1
            if not judged_valid(compiled, encode, test["data"], rewrite_schema(row["schema"]), test["valid"]):
                wrong.append(f"{row['id']}: valid={test['valid']} {compact(test['data'])[:80]}")
            if test["valid"] is False:
                assert not accepts_text(compiled, encode, compact(test["data"]))
    assert not wrong, wrong
    assert checked >= 30, checked


# --- siblings the library would have to intersect into a reference cycle -------------------
LIST_DEFINITIONS = {
    "list": {"type": "object", "properties": {"kind": {"const": "list"}, "items": {"type": "array", "items": {"$ref": "#"}}},
             "required": ["kind"], "additionalProperties": False},
    "text": {"type": "object", "properties": {"kind": {"const": "text"}, "text": {"type": "string"}},
             "required": ["kind"]}}
NESTED_LISTS = [{"kind": "text"}, {"kind": "text", "text": "a", "x": 1}, {"kind": "list", "items": []},
                {"kind": "list", "items": [{"kind": "text"}, {"kind": "list", "items": [{"kind": "text", "text": 1}]}]},
                {"kind": "list", "items": [{"kind": "list", "items": [{"kind": "text"}]}]}, {"kind": "list", "x": 1},
                {"kind": "other"}, {}, "s", None]


def test_siblings_of_any_of_that_every_branch_implies_go_and_a_cycle_compiles(judge):
    """A type every branch already has, and additionalProperties: {} (admits anything)."""
    schema = {"type": "object", "additionalProperties": {}, "title": "t", "definitions": LIST_DEFINITIONS,
              "anyOf": [{"$ref": "#/definitions/list"}, {"$ref": "#/definitions/text"}]}
    assert "circular" in (library_refusal(schema) or "")
    rewritten = judge(schema, NESTED_LISTS)
    assert "type" not in rewritten and "additionalProperties" not in rewritten


@pytest.mark.parametrize("sibling", [
    {"type": "integer"},  # a branch's number may be 1.5: an integer type is not implied
    {"type": ["object", "string"], "additionalProperties": False},  # asserts something
])
def test_siblings_of_any_of_that_assert_something_stay(sibling):
    schema = {"anyOf": [{"type": "number"}, {"type": "object"}], **sibling}
    assert rewrite_schema(schema) == schema
    annotated = {"anyOf": [{"type": "object"}], "additionalProperties": {}, "unevaluatedProperties": False}
    assert rewrite_schema(annotated) == annotated  # unevaluatedProperties reads what {} evaluated


def test_siblings_of_a_draft_07_ref_are_ignored_as_the_draft_says(judge):
    """Draft-07 and earlier ignore every sibling of $ref; the library would apply them."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": LIST_DEFINITIONS,
              "properties": {"doc": {"$ref": "#/definitions/list", "type": "string", "description": "d",
                                     "dependencies": {"kind": ["x"]}}}}
    rewritten = judge(schema, [{"doc": value} for value in NESTED_LISTS] + [{}])
    assert rewritten["properties"]["doc"] == {"$ref": "#/definitions/list"}


def test_siblings_of_a_later_ref_apply_and_only_an_implied_type_goes(judge):
    schema = {"$schema": DRAFT_2020, "$defs": {"s": {"type": "string", "maxLength": 3}, "n": {"type": "number"}},
              "properties": {"implied": {"$ref": "#/$defs/s", "type": ["string", "null"]},
                             "applies": {"$ref": "#/$defs/s", "minLength": 2},
                             "narrows": {"$ref": "#/$defs/n", "type": "integer"}}}
    # Not 2.0: an integer to JSON Schema, which the library's integer grammar does not generate.
    values = ["", "ab", "abcd", None, 1, 1.5]
    instances = [{key: value} for key in schema["properties"] for value in values]
    rewritten = judge(schema, instances, jsonschema.Draft202012Validator)
    assert rewritten["properties"]["implied"] == {"$ref": "#/$defs/s"}
    assert rewritten["properties"]["applies"] == schema["properties"]["applies"]
    assert rewritten["properties"]["narrows"] == schema["properties"]["narrows"]


def test_nothing_a_reference_points_into_is_moved_or_removed():
    """A rewrite that moved oneOf's branches, a dependency's schema, a not, or a draft-07 $ref's
    ignored sibling would leave a reference to them dangling: those stay as written (refused)."""
    schema = {"type": "object", "properties": {
        "a": {"oneOf": [{"type": "string"}, {"type": "null"}]},
        "b": {"dependencies": {"x": {"required": ["y"]}}},
        "c": {"not": {"type": "string", "title": "t"}},
        "d": {"not": {}, "definitions": {"s": {"type": "string"}}},
        "uses": {"anyOf": [{"$ref": "#/properties/a/oneOf/0"}, {"$ref": "#/properties/b/dependencies/x"},
                           {"$ref": "#/properties/c/not"}, {"$ref": "#/properties/d/definitions/s"}]}}}
    assert rewrite_schema(schema) == schema
    draft_07 = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"o": {"type": "object"}},
                "properties": {"p": {"$ref": "#/definitions/o", "properties": {"q": {"type": "integer"}}},
                               "r": {"$ref": "#/properties/p/properties/q"}}}
    assert rewrite_schema(draft_07) == draft_07
