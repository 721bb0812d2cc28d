"""The dashboards' vocabulary and their rendering: the label selectors and query builders every
panel uses, the Panel and Board a dashboard is written in (observability_boards.py), and the
Grafana JSON (grafanalib) a Board becomes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

from kvscale import metric_names as m

# A reference to the data source variable, never a UID of someone's Prometheus.
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
# Selectors: server series carry all four labels; the operator's carry namespace and
# inferenceservice; the router's also carry its own pod.
SEL_SERVER = ('namespace=~"$namespace", inferenceservice=~"$inferenceservice", '
              'model_name=~"$model_name", pod=~"$pod"')
SEL_SERVICE = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice"'
NOT_2XX = 'status!~"2.."'
SEL_ROUTER = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice", pod=~"$pod"'


def sel(series: str, selector: str, extra: str = "") -> str:
    inner = f"{selector}, {extra}" if extra else selector
    return f"{series}{{{inner}}}"


def rate(series: str, selector: str, extra: str = "") -> str:
    return f"rate({sel(series, selector, extra)}[{RATE}])"


def quantile(q: float, metric: m.Metric, selector: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({rate(metric.bucket, selector)}))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    width: int = 12
    bars: bool = False


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    pod_source: str  # the series whose `pod` label the pod variable lists
    annotations: tuple[tuple[str, str], ...] = field(default=())  # (name, expr)
    # The series whose namespace / inferenceservice / model_name the variables list: the
    # servers' by default; the router board lists routers, whether or not their servers run.
    service_source: str = m.NUM_REQUESTS_RUNNING.series


def q(expr: str, legend: str) -> Query:
    return Query(expr, legend)


def variables(board: Board) -> g.Templating:
    def label_var(name: str, series: str, selector: str) -> g.Template:
        return g.Template(
            name=name, label=name, dataSource=DS, query=f"label_values({series}{{{selector}}}, {name})",
            includeAll=True, multi=True, allValue=".*", refresh=2, sort=1,
            default="$__all")

    source = board.service_source
    return g.Templating(list=[
        g.Template(name="datasource", label="Data source", type="datasource", query="prometheus",
                   default="default"),
        label_var("namespace", source, ""),
        label_var("inferenceservice", source, 'namespace=~"$namespace"'),
        label_var("model_name", source, SEL_SERVICE),
        label_var("pod", board.pod_source, SEL_SERVICE),
    ])


def build(board: Board) -> dict:
    panels = []
    x = y = 0
    for i, panel in enumerate(board.panels):
        if x + panel.width > 24:
            x, y = 0, y + 8
        targets = [g.Target(expr=query.expr, legendFormat=query.legend, refId=chr(ord("A") + j),
                            datasource=DS)
                   for j, query in enumerate(panel.queries)]
        panels.append(g.TimeSeries(
            title=panel.title, description=panel.description, dataSource=DS, targets=targets,
            unit=panel.unit, id=i + 1, gridPos=g.GridPos(h=8, w=panel.width, x=x, y=y),
            drawStyle="bars" if panel.bars else "line", fillOpacity=60 if panel.bars else 10,
            legendDisplayMode="list", legendPlacement="bottom"))
        x += panel.width
    annotations = g.Annotations(list=[
        {"name": name, "datasource": DS, "enable": True, "expr": expr, "iconColor": "orange",
         "titleFormat": "scaled {{direction}}", "textFormat": "{{inferenceservice}}: {{reason}}",
         "useValueForTime": False, "step": "30s"}
        for name, expr in board.annotations])
    dashboard = g.Dashboard(
        title=board.title, uid=board.uid, description=board.description, tags=["kvscale"],
        panels=panels, templating=variables(board), annotations=annotations, refresh="30s",
        time=g.Time("now-1h", "now"), timezone="browser", editable=True, graphTooltip=1,
    ).auto_panel_ids()
    return json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder))
