"""Shared by the observability tests: the dashboards generator (tools/gen_observability.py and the
observability_*.py modules beside it, loaded by path since tools/ is no package) and the queries
its outputs hold."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvscale import metric_names as names

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "kvscale"


def _tools_on_path() -> None:
    """The generator's modules import one another by name, as when it runs as a script."""
    if str(REPO_ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "tools"))


def tools_module(name: str):
    """One of the modules beside the generator in tools/ (``observability_rules``, ...)."""
    _tools_on_path()
    return importlib.import_module(name)


def load_generator():
    """A fresh copy of the generator's command-line module (tests patch its paths)."""
    _tools_on_path()
    spec = importlib.util.spec_from_file_location(
        "gen_observability", REPO_ROOT / "tools" / "gen_observability.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    legend: str
    expr: str

    @property
    def where(self) -> str:
        return f"dashboard {self.dashboard!r}, panel {self.panel!r}, query {self.legend!r}"


def committed_dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def committed_rules() -> dict:
    return yaml.safe_load((CHART / "rules" / "kvscale.rules.yaml").read_text())


def panel_queries() -> list[PanelQuery]:
    """Every target of every panel, and every annotation query, of the committed dashboards."""
    out = []
    for name, board in committed_dashboards().items():
        for panel in board["panels"]:
            for target in panel["targets"]:
                out.append(PanelQuery(name, panel["title"], target["legendFormat"], target["expr"]))
        for annotation in board["annotations"]["list"]:
            if "expr" in annotation:
                out.append(PanelQuery(name, f"annotation {annotation['name']}", "", annotation["expr"]))
    return out


_KEYWORDS = {"bool", "and", "or", "unless", "offset", "inf", "nan"}


def metric_names_in(expr: str) -> set[str]:
    """The series names an expression selects (a rough PromQL tokenizer: it drops strings, label
    matchers, grouping clauses and ranges, then keeps identifiers that are not function calls)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    return {name for name, call in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text)
            if not call and name.lower() not in _KEYWORDS}


def contract_metric(sample: str) -> names.Metric | None:
    for metric in names.ALL_METRICS:
        if sample in names.exposed_sample_names(metric):
            return metric
    return None
