"""Local JSON-pointer references (``"$ref": "#/definitions/a"``) inside one schema: a pointer's
tokens, the subschema it names, every pointer a schema holds, and whether a nested ``$id`` makes
such pointers resolve elsewhere (then nothing follows them)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from kvscale.server.structured_outputs.schema_keywords import DATA_KEYWORDS, MAP_KEYWORDS


def pointer_tokens(ref: str) -> tuple[str, ...] | None:
    """The tokens of a local JSON-pointer reference ("#/a/b~1c" -> ("a", "b/c")), else None."""
    pointer = unquote(ref[1:])
    if not ref.startswith("#") or (pointer and not pointer.startswith("/")):
        return None
    return tuple(token.replace("~1", "/").replace("~0", "~") for token in pointer.split("/")[1:])


def resolve_local_ref(root: Any, ref: Any) -> Any:
    """The subschema of ``root`` a local JSON-pointer ``$ref`` names, or None (remote, an anchor,
    nothing there). Only right where no subschema below the root sets its own base URI
    (:func:`has_nested_id`)."""
    tokens = pointer_tokens(ref) if isinstance(ref, str) else None
    if tokens is None:
        return None
    node = root
    for token in tokens:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def local_pointers(schema: Any) -> list[tuple[str, ...]]:
    """The pointer of every local ``$ref`` anywhere in ``schema`` (data included: a false alarm
    only keeps a rewrite from being made)."""
    found: list[tuple[str, ...]] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            tokens = pointer_tokens(ref) if isinstance(ref, str) else None
            if tokens:
                found.append(tokens)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def has_nested_id(schema: Any, top: bool) -> bool:
    """Whether a subschema below the root declares its own base URI (``$id``, draft-04 ``id``).
    Walks every dict and list but data keywords; a property *named* id is a map key, and a map's
    values are schemas, so both are judged as schemas (a false alarm only disables the proof)."""
    if isinstance(schema, list):
        return any(has_nested_id(item, False) for item in schema)
    if not isinstance(schema, dict):
        return False
    if not top and (isinstance(schema.get("$id"), str) or isinstance(schema.get("id"), str)):
        return True
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            continue
        if key in MAP_KEYWORDS and isinstance(value, dict):
            if any(has_nested_id(item, False) for item in value.values()):
                return True
        elif has_nested_id(value, False):
            return True
    return False
