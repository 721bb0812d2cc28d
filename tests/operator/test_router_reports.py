"""The PrefixRouting condition from what router pods report of their tokenizers."""

from __future__ import annotations

from kvscale.operator.router_reports import (
    RouterReport,
    health_url,
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


def test_demand_sums_held_and_is_as_idle_as_the_busiest_router() -> None:
    from kvscale.operator.router_reports import demand_from_reports
    from kvscale.operator.scaling import Demand

    def health(held: int, idle: float) -> dict:
        return {"tokenizers": [], "activation": {"enabled": True, "held": held, "idle_seconds": idle,
                                                 "last_cold_start_seconds": 4.5}}

    a, b = report_from_health("r-1", health(3, 0.0)), report_from_health("r-2", health(0, 42.0))
    assert (a.held, a.idle_seconds, a.last_cold_start_s) == (3, 0.0, 4.5)
    assert demand_from_reports([a, b]) == Demand(held=3, idle_seconds=0.0)
    assert demand_from_reports([b]) == Demand(held=0, idle_seconds=42.0)
    # A router that could not be asked, or an older one that does not say: never idle.
    silent = RouterReport("r-3", {}, "/health: timed out")
    older = report_from_health("r-4", {"tokenizers": []})
    assert demand_from_reports([b, silent]).idle_seconds is None
    assert demand_from_reports([b, older]).idle_seconds is None
    assert demand_from_reports([]) == Demand(held=0, idle_seconds=None)


def test_demand_sums_the_requests_waiting_in_the_routers_queues() -> None:
    from kvscale.operator.router_reports import MAX_QUEUED, demand_from_reports

    a = report_from_health("r-1", {"tokenizers": [], "queued": 7})
    b = report_from_health("r-2", {"tokenizers": [], "queued": 5,
                                   "activation": {"enabled": False, "held": 0, "idle_seconds": 0.0}})
    assert (a.queued, b.queued) == (7, 5) and demand_from_reports([a, b]).queued == 12
    for bad in (-3, "7", True, 2.5, None):
        assert report_from_health("r-3", {"tokenizers": [], "queued": bad}).queued == 0
    assert report_from_health("r-4", {"tokenizers": [], "queued": 10**12}).queued == MAX_QUEUED


def test_a_router_pods_health_is_read_at_its_ip_or_beside_an_honoured_metrics_url() -> None:
    pod = {"metadata": {"name": "r-1", "annotations": {
        "serving.kvscale.io/metrics-url": "http://127.0.0.1:9000/metrics"}},
        "status": {"podIP": "fd00::7"}}
    assert health_url(pod, allow_override=False) == "http://[fd00::7]:8080/health"
    assert health_url(pod, allow_override=True) == "http://127.0.0.1:9000/health"
    assert health_url({"metadata": {"name": "r-2"}, "status": {}}, allow_override=True) is None
