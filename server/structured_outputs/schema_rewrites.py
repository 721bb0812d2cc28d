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
  ``type`` lets through) is ``anyOf``: no instance can match two. The proof (schema_shapes.py)
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
from typing import Any

from kvscale.server.structured_outputs.schema_keywords import (
    ANNOTATIONS,
    LIST_KEYWORDS,
    MAP_KEYWORDS,
    SCHEMA_KEYWORDS,
    admitted_types,
)
from kvscale.server.structured_outputs.schema_negation import negation
from kvscale.server.structured_outputs.schema_refs import has_nested_id, local_pointers
from kvscale.server.structured_outputs.schema_shapes import PROOF_DEPTH, Shapes

# What stays beside a draft-07-or-earlier $ref, whose other siblings are ignored: the subschemas
# other references may name, and what sets the base URI.
KEEP_BESIDE_REF = frozenset({"definitions", "$defs", "$schema", "$id", "id"})


def rewrite_schema(schema: Any) -> Any:
    """``schema`` with every provable rewrite applied (a new object; the argument is untouched)."""
    return _Rewriter(schema).node(schema, ())


class _Rewriter:
    def __init__(self, root: Any) -> None:
        declared = root.get("$schema", "") if isinstance(root, dict) else ""
        declared = declared if isinstance(declared, str) else ""
        # Which spelling of dependencies the schema's draft defines; with no $schema, both (each
        # means what its author wrote it for, and neither is an annotation in the other draft).
        self.new_draft = "2019-09" in declared or "2020-12" in declared
        self.old_draft = bool(declared) and not self.new_draft
        # A local "#/..." pointer is relative to the nearest enclosing $id: with nested $ids the
        # proof does not follow references at all.
        self.shapes = Shapes(root, refs_resolvable=not has_nested_id(root, top=True))
        # 2019-09's unevaluatedProperties sees what additionalProperties evaluated, even {}.
        self.reads_annotations = '"unevaluatedProperties"' in json.dumps(root)
        # Every path a local reference passes through: a rewrite that moves or removes what such a
        # path names would leave the reference dangling, so there nothing is rewritten.
        self.referenced: set[tuple[str, ...]] = set()
        for pointer in local_pointers(root):
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
            negated = negation(out["not"])
            if negated is False and not any(self.keeps(path, key) for key in out):
                return False
            if negated is not None and negated is not False:
                del out["not"]
                if negated is not True:
                    conjuncts.append(negated)
        if isinstance(out.get("oneOf"), list) and not self.keeps(path, "oneOf"):
            proof = self.shapes.one_of(schema)
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
            admitted = admitted_types(node["type"])
            target = self.shapes.resolve(node["$ref"])
            if admitted and target is not None and self.shapes.shape(target, PROOF_DEPTH).possible_types() <= admitted:
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
            admitted = admitted_types(node["type"])
            if admitted and all(self.shapes.shape(branch, PROOF_DEPTH).possible_types() <= admitted
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


def _every_string_passes(schema: Any) -> bool:
    """True only if every string is valid under ``schema``: nothing but annotations and a
    ``type`` that admits strings (an under-approximation: False may be wrong)."""
    if schema is True:
        return True
    if not isinstance(schema, dict) or set(schema) - ANNOTATIONS - {"type"}:
        return False
    return "type" not in schema or "string" in admitted_types(schema["type"])


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
