"""The PrefixRouting condition from what router pods report of their tokenizers (issue 19)."""

from __future__ import annotations

from kvscale.operator.router_reports import (
    RouterReport,
    prefix_routing_condition,
    report_from_health,
)


def test_a_router_without_a_tokenizer_turns_the_condition_false_and_names_it() -> None:
    ok = report_from_health("r-1", {"status": "ok", "tokenizers": [{"model": "m", "loaded": True}]})
    lost = report_from_health("r-2", {"status": "no healthy replica", "tokenizers": [
        {"model": "m", "loaded": False, "error": "OSError: no tokenizer.json in /models/hf/org/m"}]})
    assert ok == RouterReport("r-1", {}) and lost.missing == {"m": "OSError: no tokenizer.json in /models/hf/org/m"}
    condition = prefix_routing_condition([ok, lost])
    assert (condition.type, condition.status, condition.reason) == ("PrefixRouting", False, "TokenizerUnavailable")
    assert "r-2" in condition.message and "no tokenizer for m" in condition.message
    assert "tokenizer.json" in condition.message


def test_every_answering_router_with_its_tokenizers_is_true_and_none_answering_unknown() -> None:
    ok = RouterReport("r-1", {})
    unreachable = RouterReport("r-2", {}, "/health: connection refused")
    assert prefix_routing_condition([ok, unreachable]).status is True
    unknown = prefix_routing_condition([unreachable])
    assert unknown.status is None and unknown.reason == "RoutersNotReporting"
    assert "connection refused" in unknown.message
    assert prefix_routing_condition([]).status is None
    old = report_from_health("r-3", {"status": "ok"})
    assert old.error and prefix_routing_condition([old]).status is None
