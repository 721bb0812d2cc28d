"""The proof that a ``oneOf``'s branches are pairwise disjoint, so that it may become ``anyOf``
(schema_rewrites.py): each branch over-approximated by the instances it may accept (a Shape: its
possible JSON types, its possible values, for objects the properties it requires, constrains or
forbids), and two shapes proven to share no instance. Every approximation is sound (looser than
the schema), so the proof only ever gives up, never claims a false disjointness."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvscale.server.structured_outputs.schema_keywords import (
    ALL_TYPES,
    ANNOTATIONS,
    OBJECT_KEYWORDS,
    TYPE_NAMES,
    json_type_name,
    type_of,
)
from kvscale.server.structured_outputs.schema_refs import resolve_local_ref

# How deep the disjointness proof follows properties and references (it only ever gives up).
PROOF_DEPTH = 4


@dataclass
class Shape:
    """An over-approximation of the instances a schema accepts."""

    types: frozenset[str] | None = None  # JSON types it may accept (integer counted as number)
    values: list[Any] | None = None  # None: any value; else the instance is one of these
    properties: dict[str, list[Any]] = field(default_factory=dict)  # name -> schemas its value meets
    required: set[str] = field(default_factory=set)
    allowed_keys: set[str] | None = None  # None: any key; else an object has only these keys

    def possible_types(self) -> frozenset[str]:
        types = ALL_TYPES if self.types is None else self.types
        if self.values is not None:
            types = types & frozenset(type_of(value) for value in self.values)
        return types

    def restrict_values(self, values: list[Any]) -> None:
        if self.values is None:
            self.values = list(values)
        else:
            # Python's == holds wherever JSON equality does (and also for True == 1): keeping
            # every value that equals one of the other list keeps at least the true intersection.
            self.values = [value for value in self.values if any(value == other for other in values)]

    def meet(self, other: Shape) -> None:
        """Both shapes hold (allOf)."""
        if other.types is not None:
            self.types = other.types if self.types is None else self.types & other.types
        if other.values is not None:
            self.restrict_values(other.values)
        for name, subs in other.properties.items():
            self.properties.setdefault(name, []).extend(subs)
        self.required |= other.required
        if other.allowed_keys is not None:
            self.allowed_keys = (set(other.allowed_keys) if self.allowed_keys is None
                                 else self.allowed_keys & other.allowed_keys)


class Shapes:
    """The shapes of one schema's subschemas, following its local references where they resolve
    (no nested ``$id``), and the ``oneOf`` proof built on them."""

    def __init__(self, root: Any, refs_resolvable: bool) -> None:
        self.root = root
        self.refs_resolvable = refs_resolvable

    def one_of(self, node: dict[str, Any]) -> list[Any] | None:
        """None unless the node's ``oneOf`` may become ``anyOf``; then the conjuncts that must
        come with it. Only the instances the node's own ``type`` lets through need disjoint
        branches. And where every branch (two or more) accepts every non-object, a non-object
        matches them all, so oneOf rejects it: "an object" plus disjointness among objects."""
        branches = node["oneOf"]
        domain = Shape()
        if "type" in node:
            domain = self.shape({"type": node["type"]}, PROOF_DEPTH)
        if self.pairwise_disjoint(branches, domain):
            return []
        if len(branches) >= 2 and all(self.accepts_every_non_object(b, PROOF_DEPTH) for b in branches):
            domain.meet(Shape(types=frozenset({"object"})))
            if self.pairwise_disjoint(branches, domain):
                return [{"type": "object"}]
        return None

    def pairwise_disjoint(self, branches: list[Any], domain: Shape) -> bool:
        shapes = []
        for branch in branches:
            shape = self.shape(branch, PROOF_DEPTH)
            shape.meet(domain)
            shapes.append(shape)
        return all(disjoint(a, b, self, PROOF_DEPTH) for i, a in enumerate(shapes) for b in shapes[i + 1:])

    def accepts_every_non_object(self, schema: Any, depth: int) -> bool:
        """True only if ``schema`` holds for every instance that is not an object: it has only
        keywords that apply to objects alone (an under-approximation: False may be wrong)."""
        if schema is True:
            return True
        if not isinstance(schema, dict) or depth <= 0:
            return False
        if "$ref" in schema:
            target = self.resolve(schema["$ref"])
            others = set(schema) - {"$ref"} - ANNOTATIONS
            # Whether or not the siblings apply (draft-07 ignores them), they must pass too.
            return target is not None and others <= OBJECT_KEYWORDS and self.accepts_every_non_object(target, depth - 1)
        return set(schema) - ANNOTATIONS - {"$schema", "$id", "id", "definitions", "$defs"} <= OBJECT_KEYWORDS

    def shape(self, schema: Any, depth: int) -> Shape:
        """What ``schema`` may accept, over-approximated (a looser shape is always sound)."""
        if schema is False:
            return Shape(types=frozenset())
        if not isinstance(schema, dict) or depth <= 0:
            return Shape()
        if "$ref" in schema:
            # Draft-07 ignores $ref's siblings, 2019-09 applies them: the target alone is sound
            # for both (a looser shape).
            target = self.resolve(schema["$ref"])
            return self.shape(target, depth - 1) if target is not None else Shape()
        shape = Shape()
        if "type" in schema:
            named = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if all(name in TYPE_NAMES for name in named):  # not draft-03's "any" or a schema
                shape.types = frozenset(json_type_name(name) for name in named)
        if "const" in schema:
            shape.restrict_values([schema["const"]])
        if isinstance(schema.get("enum"), list):
            shape.restrict_values(schema["enum"])
        if isinstance(schema.get("properties"), dict):
            for name, sub in schema["properties"].items():
                shape.properties.setdefault(name, []).append(sub)
        if isinstance(schema.get("required"), list):
            shape.required |= {name for name in schema["required"] if isinstance(name, str)}
        if schema.get("additionalProperties") is False and not schema.get("patternProperties"):
            declared = schema.get("properties")
            shape.allowed_keys = set(declared) if isinstance(declared, dict) else set()
        for sub in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
            shape.meet(self.shape(sub, depth - 1))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                # Any one branch: the union of the branches' types (values and properties dropped).
                types: frozenset[str] = frozenset()
                for sub in schema[key]:
                    branch = self.shape(sub, depth - 1)
                    types |= branch.possible_types()
                shape.meet(Shape(types=types))
        return shape

    def resolve(self, ref: Any) -> Any:
        """The subschema a local JSON-pointer ``$ref`` names, or None (remote, anchors, $id)."""
        return resolve_local_ref(self.root, ref) if self.refs_resolvable else None


def disjoint(a: Shape, b: Shape, shapes: Shapes, depth: int) -> bool:
    """True only if no instance can satisfy both shapes."""
    if a.values is not None and b.values is not None:
        if not any(x == y for x in a.values for y in b.values):
            return True
    common = a.possible_types() & b.possible_types()
    if not common:
        return True
    if common != {"object"} or depth <= 0:
        return False
    # Both accept only objects: a property one of them requires (so it is there) that the other
    # allows no object to have, or whose value cannot satisfy what each says of it.
    for needs, other in ((a, b), (b, a)):
        if other.allowed_keys is not None and needs.required - other.allowed_keys:
            return True
    for name in (a.required | b.required) & a.properties.keys() & b.properties.keys():
        left, right = Shape(), Shape()
        for sub in a.properties[name]:
            left.meet(shapes.shape(sub, depth - 1))
        for sub in b.properties[name]:
            right.meet(shapes.shape(sub, depth - 1))
        if disjoint(left, right, shapes, depth - 1):
            return True
    return False
