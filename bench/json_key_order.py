"""Judging JSON test instances with a compiled grammar (bench.grammar_libraries, the tests).

llguidance generates an object's declared properties in the order the schema declares them, then
any others: a valid instance whose keys come in another order is rejected as written, though JSON
Schema ignores key order. So a valid instance counts as accepted when it is accepted in the order
given or in some other key order (a search, each object's keys tried in the schema's order first),
and an invalid one must be rejected both as given and with its keys in the schema's order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvscale.server.structured_outputs import backend

Encode = Callable[[str], list[int]]
DATA_KEYWORDS = ("const", "enum", "default", "examples")


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def accepts_text(compiled: Any, encode: Encode, text: str) -> bool:
    matcher = backend.Matcher.of(compiled)
    return all(matcher.consume(token) for token in encode(text)) and matcher.is_accepting()


def declared_rank(schema: Any) -> dict[str, int]:
    """Every property name the schema declares, ranked by where it is first declared."""
    rank: dict[str, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                for name in node["properties"]:
                    rank.setdefault(name, len(rank))
            for key, value in node.items():
                if key not in DATA_KEYWORDS:
                    walk(value)

    walk(schema)
    return rank


def in_rank_order(value: Any, rank: dict[str, int]) -> Any:
    """``value`` with every object's keys sorted by ``rank`` (undeclared keys last, as they were)."""
    if isinstance(value, list):
        return [in_rank_order(item, rank) for item in value]
    if isinstance(value, dict):
        keys = sorted(value, key=lambda key: rank.get(key, len(rank)))
        return {key: in_rank_order(value[key], rank) for key in keys}
    return value


def judged_valid(compiled: Any, encode: Encode, instance: Any, schema: Any, valid: bool) -> bool:
    """Whether the grammar judges ``instance`` as the schema does (see the module's docstring)."""
    rank = declared_rank(schema)
    if not valid:
        return not (accepts_text(compiled, encode, compact(instance))
                    or accepts_text(compiled, encode, compact(in_rank_order(instance, rank))))
    if accepts_text(compiled, encode, compact(instance)):
        return True
    matcher = _KeyOrderSearch(encode, rank).feed(backend.Matcher.of(compiled), instance)
    return matcher is not None and matcher.is_accepting()


class _KeyOrderSearch:
    """Feeds a value fragment by fragment, backtracking over each object's key order; gives up
    after ``budget`` fragments (then the instance counts as rejected)."""

    def __init__(self, encode: Encode, rank: dict[str, int], budget: int = 5000) -> None:
        self.encode = encode
        self.rank = rank
        self.budget = budget

    def feed(self, matcher: backend.Matcher, value: Any) -> backend.Matcher | None:
        """The matcher after ``value`` in some key order, or None."""
        if not _holds_object(value):
            return matcher if self._text(matcher, compact(value)) else None
        if isinstance(value, list):
            if not self._text(matcher, "["):
                return None
            for i, item in enumerate(value):
                if i and not self._text(matcher, ","):
                    return None
                fed = self.feed(matcher, item)
                if fed is None:
                    return None
                matcher = fed
            return matcher if self._text(matcher, "]") else None
        if not self._text(matcher, "{"):
            return None
        return self._members(matcher, value, list(value), first=True)

    def _members(self, matcher: backend.Matcher, obj: dict[str, Any], left: list[str],
                 first: bool) -> backend.Matcher | None:
        if not left:
            return matcher if self._text(matcher, "}") else None
        for key in sorted(left, key=lambda name: self.rank.get(name, len(self.rank))):
            trial = matcher.copy()
            if not self._text(trial, ("" if first else ",") + compact(key) + ":"):
                continue
            fed = self.feed(trial, obj[key])
            done = fed and self._members(fed, obj, [k for k in left if k != key], first=False)
            if done is not None or self.budget < 0:
                return done or None
        return None

    def _text(self, matcher: backend.Matcher, text: str) -> bool:
        self.budget -= 1
        return self.budget >= 0 and all(matcher.consume(token) for token in self.encode(text))


def _holds_object(value: Any) -> bool:
    if isinstance(value, dict):
        return True
    return isinstance(value, list) and any(_holds_object(item) for item in value)
