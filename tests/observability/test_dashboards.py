"""The committed dashboards and rules are the generator's output, and every query in them is
well-formed by the rules the issue names: the datasource is a variable, counters only appear
under rate()/increase(), quantiles come from `sum by (le)` of bucket rates, and every series is a
contract name (kvscale/metric_names.py) or one of our recording rules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from observability_helpers import (  # noqa: E402
    CHART,
    REPO_ROOT,
    committed_dashboards,
    committed_rules,
    contract_metric,
    load_generator,
    metric_names_in,
    panel_queries,
)

from kvscale import metric_names as names  # noqa: E402

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
VARIABLES = ["datasource", "namespace", "inferenceservice", "model_name", "pod"]


def test_committed_files_equal_the_generator_output() -> None:
    generator = load_generator()
    for path, text in generator.rendered().items():
        assert path.exists(), f"{path.relative_to(REPO_ROOT)} missing: run `make dashboards`"
        assert path.read_text() == text, f"{path.relative_to(REPO_ROOT)} is stale: run `make dashboards`"
    assert set(committed_dashboards()) == {"autoscaling", "serving", "router"}


def test_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch) -> None:
    generator = load_generator()
    monkeypatch.setattr(generator, "DASHBOARD_DIR", tmp_path)
    monkeypatch.setattr(generator, "RULES_FILE", tmp_path / "rules.yaml")
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    assert generator.main([]) == 0
    assert generator.main(["--check"]) == 0
    (tmp_path / "router.json").write_text("{}")
    assert generator.main(["--check"]) == 1


@pytest.mark.parametrize("name", ["autoscaling", "serving", "router"])
def test_dashboard_variables_and_datasource(name: str) -> None:
    board = committed_dashboards()[name]
    variables = board["templating"]["list"]
    assert [v["name"] for v in variables] == VARIABLES
    assert variables[0]["type"] == "datasource" and variables[0]["query"] == "prometheus"
    for variable in variables[1:]:
        assert variable["datasource"] == DATASOURCE
        assert variable["query"].startswith("label_values(")
    for panel in board["panels"]:
        # A hard-coded datasource UID is what makes shipped dashboards show "No data".
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
    for annotation in board["annotations"]["list"]:
        assert annotation["datasource"] == DATASOURCE
        assert panel["targets"], panel["title"]


def test_the_router_board_lists_routers_whether_or_not_their_servers_run() -> None:
    """Its service variables come from the routers' own series: a service whose servers are all
    down (or a router in front of none yet) still has its router board."""
    variables = {v["name"]: v for v in committed_dashboards()["router"]["templating"]["list"]}
    for name in ("namespace", "inferenceservice", "model_name"):
        assert variables[name]["query"].startswith(
            f"label_values({names.ROUTER_TOKENIZER_LOADED.series}"), variables[name]["query"]


def all_exprs() -> list[tuple[str, str]]:
    out = [(q.where, q.expr) for q in panel_queries()]
    for group in committed_rules()["groups"]:
        for rule in group["rules"]:
            out.append((rule.get("record") or rule["alert"], rule["expr"]))
    return out


def test_every_series_is_a_contract_name_or_a_recording_rule() -> None:
    recorded = {r["record"] for g in committed_rules()["groups"] for r in g["rules"] if "record" in r}
    for where, expr in all_exprs():
        for series in metric_names_in(expr):
            assert series in recorded or series == "up" or contract_metric(series) is not None, (
                f"{where}: {series} is neither in kvscale/metric_names.py nor a recording rule")


def test_counters_only_under_rate_and_quantiles_from_bucket_rates() -> None:
    counters = [m.series for m in names.ALL_METRICS if m.type == names.COUNTER]
    buckets = [m.bucket for m in names.ALL_METRICS if m.type == names.HISTOGRAM]
    for where, expr in all_exprs():
        for series in counters + buckets:
            for match in re.finditer(re.escape(series) + r"(\{[^}]*\})?", expr):
                before = expr[:match.start()]
                assert re.search(r"(rate|increase)\($", before) and expr[match.end()] == "[", (
                    f"{where}: {series} used without rate()/increase() over a range")
        for match in re.finditer(r"histogram_quantile\(([0-9.]+), (.*)", expr):
            assert match.group(2).startswith("sum by (") and "le" in match.group(2).split(")")[0], (
                f"{where}: histogram_quantile over something other than sum by (le)")
        if "$__rate_interval" not in expr:
            assert not re.search(r"\[\$__interval\]", expr), where


def test_all_contract_metrics_are_used_or_documented() -> None:
    used = {s for _, expr in all_exprs() for s in metric_names_in(expr)}
    doc = (REPO_ROOT / "docs" / "observability.md").read_text()
    for metric in names.ALL_METRICS:
        assert f"`{metric.name}`" in doc, f"{metric.name} is not documented in docs/observability.md"
    # The dashboards show the new metrics the issue asks for.
    for metric in (names.KV_BLOCKS_EVICTED, names.ROUTER_SPILLS, names.OPERATOR_PANIC,
                   names.OPERATOR_SCALE_DECISIONS, names.ROUTER_REDIS_ERRORS,
                   names.OPERATOR_PREFILL_SECONDS, names.OPERATOR_TARGET_PREFILL_SECONDS,
                   names.LORA_REQUESTS):
        assert metric.series in used, metric.name


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(["promtool", "check", "rules", str(CHART / "rules" / "kvscale.rules.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 12 rules found" in result.stdout


def test_the_autoscaling_board_shows_both_measures_of_the_load_beside_it() -> None:
    """The load panel's description is the rule of operator/scaling.py (both measures, their
    larger), and the queued prefill seconds sit in the rows of the load and occupancy panels."""
    panels = committed_dashboards()["autoscaling"]["panels"]
    by_title = {p["title"]: p for p in panels}
    load = by_title["Load (replicas' worth) vs desired replicas"]
    for term in ("max(", "targetKVUsage", "targetQueueLength", "targetPrefillSeconds",
                 names.PREFILL_TOKENS_WAITING.name, names.PREFILL_TOKENS_PER_S.name):
        assert term in load["description"], term
    prefill = by_title["Queued prefill seconds vs target"]
    assert [t["expr"].split("{")[0] for t in prefill["targets"]] == [
        names.OPERATOR_PREFILL_SECONDS.series, names.OPERATOR_TARGET_PREFILL_SECONDS.series]
    assert prefill["fieldConfig"]["defaults"]["unit"] == "s"
    first_rows = {p["title"] for p in panels if p["gridPos"]["y"] <= load["gridPos"]["y"] + 8}
    assert {"Occupancy signal vs target", load["title"], prefill["title"]} <= first_rows
