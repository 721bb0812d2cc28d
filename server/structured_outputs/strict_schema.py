"""``strict: true`` on a schema: its objects hold the properties it lists and no others.

OpenAI's strict mode asks for ``additionalProperties: false`` on every object, and its answers
then carry no key the schema does not name; vLLM's default grammar backend (xgrammar's
``strict_mode``) closes objects that way on every request. Plain JSON Schema leaves an object
open where ``additionalProperties`` is absent, and a grammar that lets any further key in lets a
small model invent keys until ``max_tokens`` (docs/benchmarks.md, issue 26: most answers kvscale
cut where vLLM's ended). So where a request sets ``strict: true`` (``response_format.json_schema``
or a tool's ``function``), each object the schema leaves open gets ``additionalProperties: false``
if that provably only removes instances, and only those the request's own ``strict`` excludes:

- the node lists ``properties``, every ``required`` key among them, and ``minProperties`` no more
  than their count (closing never makes an object unsatisfiable);
- nothing else could evaluate one of its properties: the node has no ``patternProperties``,
  ``additionalProperties``, ``unevaluatedProperties`` or in-place subschemas (``allOf``,
  ``anyOf``, ``oneOf``, ``$ref``, ``if``/``then``/``else``, ``dependentSchemas``), and it is not
  itself one of several in-place parts (an ``allOf`` member, a ``then``, the target of a ``$ref``
  or an ``anyOf`` branch whose parent evaluates properties too), where closing one part would
  refuse the keys another part lists;
- the node is not under ``not``, ``if``, ``oneOf``, ``contains`` or ``propertyNames``: narrowing
  a schema there can let *more* instances through (an instance ``oneOf`` refused for matching two
  branches matches one once a branch is closed).

Every instance of the closed schema is an instance of the request's, so nothing kvscale returns
violates the schema it was given. A schema whose references do not all resolve locally (remote
or anchor ``$ref``, a nested ``$id``) is left as it is. Without ``strict`` the schema is enforced
as JSON Schema defines it.
"""

from __future__ import annotations

import copy
from typing import Any

from kvscale.server.structured_outputs.schema_rewrites import has_nested_id, resolve_local_ref

# Subschemas applied to a new instance (a property's value, an item): a fresh start.
FRESH_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
             "contentSchema")
FRESH_MAP = ("properties", "patternProperties")
FRESH_LIST = ("prefixItems", "items")
# Subschemas applied in place to the same instance beside the node's own keywords.
IN_PLACE_ONE = ("then", "else")
IN_PLACE_MAP = ("dependentSchemas", "dependencies")
IN_PLACE_LIST = ("allOf",)
# Subschemas where a narrower schema can widen what the whole accepts.
NOT_MONOTONE_ONE = ("not", "if", "contains", "propertyNames")
NOT_MONOTONE_LIST = ("oneOf",)
# Keywords that evaluate an object's properties, in the node or in place through it.
EVALUATES_PROPERTIES = frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties",
                                  "allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas",
                                  "dependencies", "$dynamicRef", "$recursiveRef"})

CLEAN, SHARED, FROZEN = "clean", "shared", "frozen"  # a node's place: alone, beside other parts, or frozen


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever the rules above allow it (a new
    object; ``schema`` itself is not changed), or ``schema`` where nothing can be closed."""
    if not isinstance(schema, dict) or has_nested_id(schema, True) or _has_unresolvable_ref(schema):
        return schema
    closed = copy.deepcopy(schema)
    places: dict[int, tuple[dict[str, Any], bool]] = {}
    _visit(closed, closed, CLEAN, places, set())
    changed = False
    for node, alone in places.values():
        if alone and _closable(node):
            node["additionalProperties"] = False
            changed = True
    return closed if changed else schema


def _closable(node: dict[str, Any]) -> bool:
    properties = node.get("properties")
    if not isinstance(properties, dict) or not properties or EVALUATES_PROPERTIES & (node.keys() - {"properties"}):
        return False
    required = node.get("required", [])
    if not isinstance(required, list) or any(key not in properties for key in required):
        return False
    least = node.get("minProperties", 0)
    return isinstance(least, int) and least <= len(properties)


def _visit(node: Any, root: dict[str, Any], place: str, places: dict[int, tuple[dict[str, Any], bool]],
           seen: set[tuple[int, str]]) -> None:
    if not isinstance(node, dict) or (id(node), place) in seen:
        return
    seen.add((id(node), place))
    _, alone = places.get(id(node), (node, True))
    places[id(node)] = (node, alone and place == CLEAN)
    fresh = FROZEN if place == FROZEN else CLEAN
    in_place = FROZEN if place == FROZEN else SHARED
    for key, value in node.items():
        if key in FRESH_MAP and isinstance(value, dict):
            for child in value.values():
                _visit(child, root, fresh, places, seen)
        elif key in FRESH_LIST and isinstance(value, list):
            for child in value:
                _visit(child, root, fresh, places, seen)
        elif key in FRESH_ONE:
            _visit(value, root, fresh, places, seen)
        elif key in IN_PLACE_ONE:
            _visit(value, root, in_place, places, seen)
        elif key in IN_PLACE_MAP and isinstance(value, dict):
            for child in value.values():
                _visit(child, root, in_place, places, seen)
        elif key in IN_PLACE_LIST and isinstance(value, list):
            for child in value:
                _visit(child, root, in_place, places, seen)
        elif key in NOT_MONOTONE_ONE:
            _visit(value, root, FROZEN, places, seen)
        elif key in NOT_MONOTONE_LIST and isinstance(value, list):
            for child in value:
                _visit(child, root, FROZEN, places, seen)
        elif key in ("anyOf", "$ref"):
            # A branch or a reference target stands for the node alone where the node evaluates
            # no property by any other keyword.
            alone_here = place == CLEAN and not (EVALUATES_PROPERTIES & (node.keys() - {key}))
            branch_place = FROZEN if place == FROZEN else CLEAN if alone_here else SHARED
            targets = value if key == "anyOf" and isinstance(value, list) else [resolve_local_ref(root, value)]
            for child in targets:
                _visit(child, root, branch_place, places, seen)


def _has_unresolvable_ref(schema: dict[str, Any]) -> bool:
    """Whether a ``$ref`` (or a dynamic one) anywhere names something other than a local pointer
    into ``schema``: its target, and so the parts it joins, would be unknown here."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "$dynamicRef" in node or "$recursiveRef" in node:
                return True
            ref = node.get("$ref")
            if ref is not None and (not isinstance(ref, str) or resolve_local_ref(schema, ref) is None):
                return True
            stack.extend(value for key, value in node.items() if key not in ("const", "enum", "default", "examples"))
        elif isinstance(node, list):
            stack.extend(node)
    return False
