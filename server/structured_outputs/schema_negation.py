"""``not`` rewritten into keywords the grammar library enforces, for the few forms whose exact
complement is known (schema_rewrites.py lists them): ``not: {}``, a type test, one count bound,
and ``properties`` / ``required`` whose schemas have a negation themselves."""

from __future__ import annotations

from typing import Any

from kvscale.server.structured_outputs.schema_keywords import (
    ALL_TYPES,
    ANNOTATIONS,
    TYPE_NAMES,
    json_type_name,
)

# A bound on a count -> (the only type it constrains, the keyword that bounds the other way).
COUNT_BOUNDS = {"maxItems": ("array", "minItems"), "minItems": ("array", "maxItems"),
                "maxLength": ("string", "minLength"), "minLength": ("string", "maxLength")}


def negation(negated: Any) -> Any:
    """An equivalent of ``not: negated`` without ``not``: a schema, True (everything matches),
    False (nothing does), or None where no form is known."""
    if negated is True or negated == {}:
        return False
    if negated is False:
        return True
    if not isinstance(negated, dict):
        return None
    asserting = {key: value for key, value in negated.items() if key not in ANNOTATIONS}
    keys = set(asserting)
    if keys == {"type"}:
        return _other_types(asserting["type"])
    if len(keys) == 1 and next(iter(keys)) in COUNT_BOUNDS:
        return _outside_count_bound(*next(iter(asserting.items())))
    if keys and keys <= {"properties", "required"}:
        return _object_breaking(asserting.get("properties", {}), asserting.get("required", []))
    return None


def _other_types(named: Any) -> Any:
    names = named if isinstance(named, list) else [named]
    if not all(name in TYPE_NAMES for name in names):
        return None
    if "integer" in names and "number" not in names:
        return None  # "not an integer" takes in 1.5: no type list says that
    others = sorted(ALL_TYPES - {json_type_name(name) for name in names})
    return {"type": others} if others else False


def _outside_count_bound(keyword: str, bound: Any) -> Any:
    """not {maxItems: n} is "an array of n + 1 items or more" (and so on): the bound holds for
    every instance of another type, so its negation holds for none."""
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        return None
    applies_to, opposite = COUNT_BOUNDS[keyword]
    if keyword.startswith("min") and bound == 0:
        return False  # every array has at least 0 items
    limit = bound + 1 if keyword.startswith("max") else bound - 1
    return {"type": applies_to, opposite: limit}


def _object_breaking(properties: Any, required: Any) -> Any:
    """not {properties: P, required: R}: properties and required hold for every non-object, so
    their negation is an object that lacks a key of R, or has a key of P whose value breaks P's
    schema for it."""
    if not isinstance(properties, dict) or not isinstance(required, list):
        return None
    ways: list[Any] = [{"properties": {key: False}} for key in dict.fromkeys(required)]
    for key, schema in properties.items():
        broken = negation(schema)
        if broken is None:
            return None
        if broken is not False:
            ways.append({"required": [key], "properties": {key: broken}})
    return {"type": "object", "anyOf": ways} if ways else False
