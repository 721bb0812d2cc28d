"""`status.adapters` (operator/adapter_status.py): each spec adapter and how many servers the routers
report it loaded on, from the routers' /health bodies (operator/router_reports.py)."""

from __future__ import annotations

from kvscale.operator.adapter_status import MAX_ADAPTERS, adapter_status
from kvscale.operator.router_reports import RouterReport, report_from_health
from kvscale.operator.spec import parse_adapters

ADAPTERS = parse_adapters([{"name": "sql", "uri": "hf://org/sql"}, {"name": "chat", "uri": "pvc://claim/chat"}])


def _health(*replicas: tuple[str, bool, list[str]]) -> dict:
    return {"status": "ok", "tokenizers": [], "replicas": [
        {"id": rid, "healthy": healthy, "adapters": names, "index_blocks": 0} for rid, healthy, names in replicas]}


def test_each_adapter_counts_the_routable_replicas_that_have_it() -> None:
    one = report_from_health("router-1", _health(("a", True, ["sql", "chat"]), ("b", True, ["sql"]),
                                                 ("c", False, ["chat"])))  # c not routable: not counted
    other = report_from_health("router-2", _health(("b", True, ["sql", "chat"])))  # a heartbeat ahead
    assert adapter_status(ADAPTERS, [one, other]) == [
        {"name": "sql", "uri": "hf://org/sql", "loadedReplicas": 2, "replicas": 2, "loaded": True},
        {"name": "chat", "uri": "pvc://claim/chat", "loadedReplicas": 2, "replicas": 2, "loaded": True}]
    assert adapter_status(ADAPTERS, [one])[1] == {
        "name": "chat", "uri": "pvc://claim/chat", "loadedReplicas": 1, "replicas": 2, "loaded": False}


def test_nothing_reported_is_not_loaded_and_no_adapters_or_router_drops_the_field() -> None:
    unreachable = RouterReport("router-1", {}, "/health: timed out", adapters={"a": frozenset({"sql"})})
    assert [e["loaded"] for e in adapter_status(ADAPTERS, [unreachable]) or []] == [False, False]
    assert adapter_status(ADAPTERS, []) == [
        {"name": n, "uri": u, "loadedReplicas": 0, "replicas": 0, "loaded": False}
        for n, u in (("sql", "hf://org/sql"), ("chat", "pvc://claim/chat"))]
    assert adapter_status((), [unreachable]) is None
    assert adapter_status(ADAPTERS, None) is None


def test_a_routers_report_is_bounded() -> None:
    names = [f"a{i}" for i in range(1000)] + ["x" * 1000, 7]
    report = report_from_health("router-1", _health(("a", True, names)))
    assert len(report.adapters["a"]) == 256 and "x" * 1000 not in report.adapters["a"]
    many = parse_adapters([{"name": f"n{i}", "uri": f"hf://org/n{i}"} for i in range(MAX_ADAPTERS + 5)])
    assert len(adapter_status(many, [report]) or []) == MAX_ADAPTERS
