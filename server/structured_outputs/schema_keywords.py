"""JSON Schema's vocabulary as the schema rewrites read it: which keywords hold subschemas (one, a
list, a map) and which hold data, the JSON types, the keywords that assert nothing or constrain
objects alone, and what a ``type`` keyword or a value says of an instance's type."""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of subschemas, or a map of name -> subschema.
SCHEMA_KEYWORDS = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not",
                   "if", "then", "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems")
MAP_KEYWORDS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
DATA_KEYWORDS = ("const", "enum", "default", "examples")

ALL_TYPES = frozenset({"array", "boolean", "null", "number", "object", "string"})
TYPE_NAMES = ALL_TYPES | {"integer"}
# Keywords that assert nothing: a ``not`` whose schema holds only these and ``type`` is a type test.
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                         "readOnly", "writeOnly"})
# Keywords that constrain objects alone: any other instance passes them.
OBJECT_KEYWORDS = frozenset({"properties", "patternProperties", "additionalProperties", "required",
                             "minProperties", "maxProperties", "propertyNames", "dependencies",
                             "dependentRequired", "dependentSchemas", "unevaluatedProperties"})


def admitted_types(named: Any) -> frozenset[str]:
    """The shape types a ``type`` keyword admits whole (empty where unsure): an integer type
    admits no 1.5, so it admits no shape's "number"."""
    names = named if isinstance(named, list) else [named]
    if not all(name in TYPE_NAMES for name in names):
        return frozenset()
    return frozenset(name for name in names if name != "integer")


def json_type_name(name: Any) -> str:
    # integer is a subset of number: counted as number, two numeric types always overlap.
    return "number" if name == "integer" else str(name)


def type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
