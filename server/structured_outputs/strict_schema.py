"""``strict: true`` on a schema: its objects hold the properties it lists and no others.

OpenAI's strict mode asks for ``additionalProperties: false`` on every object, and its answers
then carry no key the schema does not name; vLLM's default grammar backend (xgrammar's
``strict_mode``) closes objects that way on every request. Plain JSON Schema leaves an object
open where ``additionalProperties`` is absent, and a grammar that lets any further key in lets a
small model invent keys until ``max_tokens`` (docs/performance.md, "Structured outputs": most answers
kvscale cut where vLLM's ended). So where a request sets ``strict: true`` (``response_format.json_schema``
or a tool's ``function``), each object the schema leaves open gets ``additionalProperties: false``
if that provably only removes instances, and only those the request's own ``strict`` excludes:

- the node lists ``properties``, every ``required`` and ``dependentRequired`` key among them,
  ``minProperties`` no more than their count, and no ``const`` or ``enum`` (closing never rules
  out an object the node would otherwise take for want of a key it may not hold);
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

from kvscale.server.structured_outputs.schema_keywords import DATA_KEYWORDS
from kvscale.server.structured_outputs.schema_refs import has_nested_id, resolve_local_ref

# Subschemas applied to a new instance (a property's value, an item): a fresh start.
FRESH = frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "items",
                   "prefixItems", "additionalItems", "unevaluatedItems", "contentSchema"})
# Subschemas applied in place to the same instance beside the node's own keywords.
IN_PLACE = frozenset({"allOf", "then", "else", "dependentSchemas", "dependencies"})
# In place too, but each alone where the node evaluates nothing else: anyOf's branches, $ref's target.
ALTERNATIVES = frozenset({"anyOf", "$ref"})
# Subschemas where a narrower schema can widen what the whole accepts.
NOT_MONOTONE = frozenset({"not", "if", "contains", "propertyNames", "oneOf"})
SUBSCHEMA_KEYWORDS = FRESH | IN_PLACE | ALTERNATIVES | NOT_MONOTONE
# Keywords whose value maps names to subschemas (the others hold one subschema or a list).
MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", "dependencies"})
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
    if "const" in node or "enum" in node:
        return False  # the listed values decide; a closed object could rule them all out
    required = node.get("required", [])
    if not isinstance(required, list) or any(key not in properties for key in required):
        return False
    needed = node.get("dependentRequired", {})
    if not isinstance(needed, dict) or any(not isinstance(keys, list) or any(key not in properties for key in keys)
                                           for keys in needed.values()):
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
    for key, value in node.items():
        child_place = _child_place(key, node, place)
        if child_place is None:
            continue
        if key == "$ref":
            children = [resolve_local_ref(root, value)]
        elif key in MAPS:
            children = list(value.values()) if isinstance(value, dict) else []
        else:
            children = value if isinstance(value, list) else [value]
        for child in children:
            _visit(child, root, child_place, places, seen)


def _child_place(key: str, node: dict[str, Any], place: str) -> str | None:
    """Where the subschemas under ``key`` of ``node`` (itself at ``place``) stand; None for a
    keyword that holds no subschema."""
    if key not in SUBSCHEMA_KEYWORDS:
        return None
    if place == FROZEN or key in NOT_MONOTONE:
        return FROZEN
    if key in FRESH:
        return CLEAN
    if key in ALTERNATIVES and place == CLEAN and not EVALUATES_PROPERTIES & (node.keys() - {key}):
        return CLEAN  # a branch or a reference target stands for the node alone
    return SHARED


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
            stack.extend(value for key, value in node.items() if key not in DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return False
