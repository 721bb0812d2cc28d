"""Exact rewrites of JSON-schema keywords llguidance refuses into forms it enforces.

kvscale enforces a schema exactly or refuses it with a 400 naming the keyword. Some refused
keywords have an equivalent form in keywords the library does implement; rewriting them before
the compile answers those schemas without weakening anything. Every rewrite here accepts exactly
the instances the original accepts; where that is not proven the keyword is left as it is, and the
library's refusal names it as before:

- ``dependencies`` (draft-04/06/07), ``dependentRequired`` / ``dependentSchemas`` (2019-09+):
  "k absent, or the dependency holds" is ``anyOf: [{properties: {k: false}}, {required: [k, ...]}]``
  (a schema dependency adds its schema to the second branch). Both branches accept every
  non-object, as the keyword does, and neither changes what the node's own ``properties`` /
  ``additionalProperties`` mean (each is a separate conjunct under ``allOf``).
- ``oneOf`` whose branches are provably pairwise disjoint (among the instances the node's own
  ``type`` lets through) is ``anyOf``: no instance can match two. The proof (``_disjoint``)
  compares sound over-approximations of what each branch accepts: its possible JSON types, its
  possible values (``const`` / ``enum``) and, for objects, a property that one branch requires
  and that the other forbids (``additionalProperties: false``) or whose values the two keep apart.
  Where every branch (two or more) constrains objects alone, a non-object matches them all and
  oneOf rejects it: then ``oneOf`` is ``type: object`` and ``anyOf``, if disjoint among objects.
- ``not`` of a few forms: ``not: {}`` is ``false``; ``not: {type: T}`` is the other types;
  ``not: {maxItems: n}`` is "an array of n + 1 items or more" (likewise minItems,
  maxLength, minLength); ``not: {properties: P, required: R}`` is "an object without a key of R,
  or with a key of P whose value breaks P's schema for it" (where that schema has a negation).
- ``propertyNames`` that every string passes (``true``, ``{}``, ``{type: "string"}``, a list of
  types with ``"string"``, annotations beside): an object's keys are strings, so it asserts
  nothing and goes (the library does not implement the keyword at all).
- Siblings that assert nothing more, which the library would have to intersect into a branch
  that reaches a reference cycle (it refuses that): beside ``anyOf``, a ``type`` every branch
  already implies and ``additionalProperties: {}``; beside a draft-07-or-earlier ``$ref``, every
  sibling (that draft ignores them); beside a later ``$ref``, a ``type`` its target implies.

Nothing else is rewritten in a node beside a ``$ref``: in draft-07 and earlier, ``$ref`` makes its
siblings ignored, so adding a conjunct there would add a constraint the schema does not have. And
nothing a local ``$ref`` points into (``#/properties/a/oneOf/0``) is moved or removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

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
# What stays beside a draft-07-or-earlier $ref, whose other siblings are ignored: the subschemas
# other references may name, and what sets the base URI.
KEEP_BESIDE_REF = frozenset({"definitions", "$defs", "$schema", "$id", "id"})
# Keywords that constrain objects alone: any other instance passes them.
OBJECT_KEYWORDS = frozenset({"properties", "patternProperties", "additionalProperties", "required",
                             "minProperties", "maxProperties", "propertyNames", "dependencies",
                             "dependentRequired", "dependentSchemas", "unevaluatedProperties"})
# How deep the disjointness proof follows properties and references (it only ever gives up).
PROOF_DEPTH = 4


def rewrite_schema(schema: Any) -> Any:
    """``schema`` with every provable rewrite applied (a new object; the argument is untouched)."""
    return _Rewriter(schema).node(schema, ())


class _Rewriter:
    def __init__(self, root: Any) -> None:
        self.root = root
        declared = root.get("$schema", "") if isinstance(root, dict) else ""
        declared = declared if isinstance(declared, str) else ""
        # Which spelling of dependencies the schema's draft defines; with no $schema, both (each
        # means what its author wrote it for, and neither is an annotation in the other draft).
        self.new_draft = "2019-09" in declared or "2020-12" in declared
        self.old_draft = bool(declared) and not self.new_draft
        # A local "#/..." pointer is relative to the nearest enclosing $id: with nested $ids the
        # proof does not follow references at all.
        self.refs_resolvable = not has_nested_id(root, top=True)
        # 2019-09's unevaluatedProperties sees what additionalProperties evaluated, even {}.
        self.reads_annotations = '"unevaluatedProperties"' in json.dumps(root)
        # Every path a local reference passes through: a rewrite that moves or removes what such a
        # path names would leave the reference dangling, so there nothing is rewritten.
        self.referenced: set[tuple[str, ...]] = set()
        for pointer in _local_pointers(root):
            self.referenced |= {pointer[:i] for i in range(1, len(pointer) + 1)}

    def keeps(self, path: tuple[str, ...], key: str) -> bool:
        """Whether a reference reaches into ``key`` of the node at ``path`` (so it must stay)."""
        return path + (key,) in self.referenced

    def node(self, schema: Any, path: tuple[str, ...]) -> Any:
        if not isinstance(schema, dict):
            return schema
        out = {key: self.children(key, value, path + (key,)) for key, value in schema.items()}
        if "$ref" in out:
            return self._beside_ref(out, path)
        conjuncts: list[Any] = []
        if not self.new_draft and isinstance(out.get("dependencies"), dict) and not self.keeps(path, "dependencies"):
            conjuncts += _dependency_conjuncts(out.pop("dependencies"))
        if not self.old_draft:
            for key in ("dependentRequired", "dependentSchemas"):
                if isinstance(out.get(key), dict) and not self.keeps(path, key):
                    conjuncts += _dependency_conjuncts(out.pop(key))
        if "not" in out and not self.keeps(path, "not"):
            negated = _negation(out["not"])
            if negated is False and not any(self.keeps(path, key) for key in out):
                return False
            if negated is not None and negated is not False:
                del out["not"]
                if negated is not True:
                    conjuncts.append(negated)
        if isinstance(out.get("oneOf"), list) and not self.keeps(path, "oneOf"):
            proof = self._one_of_proof(schema)
            if proof is not None:
                branches = out.pop("oneOf")
                conjuncts += proof
                if "anyOf" in out:
                    conjuncts.append({"anyOf": branches})
                else:
                    out["anyOf"] = branches
        if "propertyNames" in out and _every_string_passes(out["propertyNames"]) and not self.keeps(path, "propertyNames"):
            del out["propertyNames"]
        if conjuncts:
            out["allOf"] = list(out.get("allOf", [])) + conjuncts
        self._drop_what_any_of_implies(out, path)
        return out

    def _beside_ref(self, node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        """A ``$ref`` node with the siblings that assert nothing dropped. In draft-07 and earlier
        ``$ref`` makes every sibling ignored; from 2019-09 (or undeclared) they apply, and only a
        ``type`` the target already implies goes. The library cannot intersect siblings into a
        target that reaches a reference cycle, and nothing else is rewritten here."""
        if self.old_draft:
            return {key: value for key, value in node.items()
                    if key == "$ref" or key in KEEP_BESIDE_REF or self.keeps(path, key)}
        if "type" in node:
            admitted = _admitted_types(node["type"])
            target = self.resolve(node["$ref"])
            if admitted and target is not None and self.shape(target, PROOF_DEPTH).possible_types() <= admitted:
                return {key: value for key, value in node.items() if key != "type"}
        return node

    def _drop_what_any_of_implies(self, node: dict[str, Any], path: tuple[str, ...]) -> None:
        """Beside ``anyOf``, a keyword every branch already implies changes nothing; the library
        cannot intersect such siblings into a branch that reaches a reference cycle, so they go:
        a ``type`` that admits every type a branch may take, and an ``additionalProperties`` that
        admits anything (unless something reads its annotation: ``unevaluatedProperties``)."""
        branches = node.get("anyOf")
        if not isinstance(branches, list) or not branches:
            return
        if (node.get("additionalProperties") in (True, {}) and not self.reads_annotations
                and not self.keeps(path, "additionalProperties")):
            del node["additionalProperties"]
        if "type" in node:
            admitted = _admitted_types(node["type"])
            if admitted and all(self.shape(branch, PROOF_DEPTH).possible_types() <= admitted
                                for branch in branches):
                del node["type"]

    def children(self, key: str, value: Any, path: tuple[str, ...]) -> Any:
        if key in SCHEMA_KEYWORDS or (key == "items" and not isinstance(value, list)):
            return self.node(value, path)
        if (key in LIST_KEYWORDS or key == "items") and isinstance(value, list):
            return [self.node(item, path + (str(i),)) for i, item in enumerate(value)]
        if key in MAP_KEYWORDS and isinstance(value, dict):
            return {name: self.node(item, path + (name,)) for name, item in value.items()}
        if key == "dependencies" and isinstance(value, dict):
            return {name: item if isinstance(item, list) else self.node(item, path + (name,))
                    for name, item in value.items()}
        return value  # const, enum, default, examples, ...: data, never schemas

    # --- oneOf: the disjointness proof ----------------------------------------------------
    def _one_of_proof(self, node: dict[str, Any]) -> list[Any] | None:
        """None unless the node's ``oneOf`` may become ``anyOf``; then the conjuncts that must
        come with it. Only the instances the node's own ``type`` lets through need disjoint
        branches. And where every branch (two or more) accepts every non-object, a non-object
        matches them all, so oneOf rejects it: "an object" plus disjointness among objects."""
        branches = node["oneOf"]
        domain = _Shape()
        if "type" in node:
            domain = self.shape({"type": node["type"]}, PROOF_DEPTH)
        if self._pairwise_disjoint(branches, domain):
            return []
        if len(branches) >= 2 and all(self._accepts_every_non_object(b, PROOF_DEPTH) for b in branches):
            domain.meet(_Shape(types=frozenset({"object"})))
            if self._pairwise_disjoint(branches, domain):
                return [{"type": "object"}]
        return None

    def _pairwise_disjoint(self, branches: list[Any], domain: _Shape) -> bool:
        shapes = []
        for branch in branches:
            shape = self.shape(branch, PROOF_DEPTH)
            shape.meet(domain)
            shapes.append(shape)
        return all(_disjoint(a, b, self, PROOF_DEPTH) for i, a in enumerate(shapes) for b in shapes[i + 1:])

    def _accepts_every_non_object(self, schema: Any, depth: int) -> bool:
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
            return target is not None and others <= OBJECT_KEYWORDS and self._accepts_every_non_object(target, depth - 1)
        return set(schema) - ANNOTATIONS - {"$schema", "$id", "id", "definitions", "$defs"} <= OBJECT_KEYWORDS

    def shape(self, schema: Any, depth: int) -> _Shape:
        """What ``schema`` may accept, over-approximated (a looser shape is always sound)."""
        if schema is False:
            return _Shape(types=frozenset())
        if not isinstance(schema, dict) or depth <= 0:
            return _Shape()
        if "$ref" in schema:
            # Draft-07 ignores $ref's siblings, 2019-09 applies them: the target alone is sound
            # for both (a looser shape).
            target = self.resolve(schema["$ref"])
            return self.shape(target, depth - 1) if target is not None else _Shape()
        shape = _Shape()
        if "type" in schema:
            named = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if all(name in TYPE_NAMES for name in named):  # not draft-03's "any" or a schema
                shape.types = frozenset(_json_type_name(name) for name in named)
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
                shape.meet(_Shape(types=types))
        return shape

    def resolve(self, ref: Any) -> Any:
        """The subschema a local JSON-pointer ``$ref`` names, or None (remote, anchors, $id)."""
        return resolve_local_ref(self.root, ref) if self.refs_resolvable else None


@dataclass
class _Shape:
    """An over-approximation of the instances a schema accepts."""

    types: frozenset[str] | None = None  # JSON types it may accept (integer counted as number)
    values: list[Any] | None = None  # None: any value; else the instance is one of these
    properties: dict[str, list[Any]] = field(default_factory=dict)  # name -> schemas its value meets
    required: set[str] = field(default_factory=set)
    allowed_keys: set[str] | None = None  # None: any key; else an object has only these keys

    def possible_types(self) -> frozenset[str]:
        types = ALL_TYPES if self.types is None else self.types
        if self.values is not None:
            types = types & frozenset(_type_of(value) for value in self.values)
        return types

    def restrict_values(self, values: list[Any]) -> None:
        if self.values is None:
            self.values = list(values)
        else:
            # Python's == holds wherever JSON equality does (and also for True == 1): keeping
            # every value that equals one of the other list keeps at least the true intersection.
            self.values = [value for value in self.values if any(value == other for other in values)]

    def meet(self, other: _Shape) -> None:
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


def _disjoint(a: _Shape, b: _Shape, rewriter: _Rewriter, depth: int) -> bool:
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
        left, right = _Shape(), _Shape()
        for sub in a.properties[name]:
            left.meet(rewriter.shape(sub, depth - 1))
        for sub in b.properties[name]:
            right.meet(rewriter.shape(sub, depth - 1))
        if _disjoint(left, right, rewriter, depth - 1):
            return True
    return False


def _admitted_types(named: Any) -> frozenset[str]:
    """The shape types a ``type`` keyword admits whole (empty where unsure): an integer type
    admits no 1.5, so it admits no shape's "number"."""
    names = named if isinstance(named, list) else [named]
    if not all(name in TYPE_NAMES for name in names):
        return frozenset()
    return frozenset(name for name in names if name != "integer")


def _json_type_name(name: Any) -> str:
    # integer is a subset of number: counted as number, two numeric types always overlap.
    return "number" if name == "integer" else str(name)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _every_string_passes(schema: Any) -> bool:
    """True only if every string is valid under ``schema``: nothing but annotations and a
    ``type`` that admits strings (an under-approximation: False may be wrong)."""
    if schema is True:
        return True
    if not isinstance(schema, dict) or set(schema) - ANNOTATIONS - {"type"}:
        return False
    return "type" not in schema or "string" in _admitted_types(schema["type"])


# --- dependencies ---------------------------------------------------------------------------
def _dependency_conjuncts(dependencies: dict[str, Any]) -> list[Any]:
    """One ``anyOf`` per dependency: "the key is absent, or everything it depends on holds"."""
    conjuncts: list[Any] = []
    for key, dependency in dependencies.items():
        absent = {"properties": {key: False}}
        if isinstance(dependency, list):  # property dependency: these keys must be there too
            present: dict[str, Any] = {"required": [key] + [name for name in dependency if name != key]}
        else:  # schema dependency: the whole instance must also validate against it
            present = {"required": [key], "allOf": [dependency]}
        conjuncts.append({"anyOf": [absent, present]})
    return conjuncts


# --- not ------------------------------------------------------------------------------------
# A bound on a count -> (the only type it constrains, the keyword that bounds the other way).
COUNT_BOUNDS = {"maxItems": ("array", "minItems"), "minItems": ("array", "maxItems"),
                "maxLength": ("string", "minLength"), "minLength": ("string", "maxLength")}


def _negation(negated: Any) -> Any:
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
    others = sorted(ALL_TYPES - {_json_type_name(name) for name in names})
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
        broken = _negation(schema)
        if broken is None:
            return None
        if broken is not False:
            ways.append({"required": [key], "properties": {key: broken}})
    return {"type": "object", "anyOf": ways} if ways else False


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


def _local_pointers(schema: Any) -> list[tuple[str, ...]]:
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
