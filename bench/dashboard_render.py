"""Draw a dashboard with matplotlib from Prometheus range-query results: one subplot per panel,
laid out like the Grafana grid (two columns; full-width panels span both), one line per series
labelled with the panel's legend format. What docs/observability.md shows: the end-to-end test
(tests/observability/test_prometheus_e2e.py) and the autoscaling replay on real replicas
(bench/autoscale_platform.py) draw their pictures with it. It lives in bench/, which the package
does not ship, so that both can import it."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (legend format, series labels, [(t, value)]) per query result
Series = tuple[str, dict[str, str], list[tuple[float, float]]]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or "value"


def _format(unit: str):
    if unit == "percentunit":
        return lambda v, _: f"{v * 100:.0f}%"
    if unit == "s":
        return lambda v, _: f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.1f} s"
    return lambda v, _: f"{v:g}"


def render_dashboard(title: str, panels: list[dict], series: dict[int, list[Series]],
                     annotations: list[float], t0: float, path: Path) -> None:
    """`panels` are the dashboard JSON's panels; `series[panel id]` their query results."""
    rows: list[list[dict]] = []
    for panel in panels:
        if panel["gridPos"]["w"] >= 24 or not rows or len(rows[-1]) == 2 or \
                rows[-1][0]["gridPos"]["w"] >= 24:
            rows.append([panel])
        else:
            rows[-1].append(panel)
    height = 3.2 * len(rows) + 0.6
    fig = plt.figure(figsize=(14, height))
    fig.suptitle(title, fontsize=14, x=0.01, y=1 - 0.15 / height, ha="left")
    grid = fig.add_gridspec(len(rows), 2, hspace=0.7, wspace=0.18, top=1 - 0.7 / height,
                            bottom=0.35 / height)
    for r, row in enumerate(rows):
        for c, panel in enumerate(row):
            ax = fig.add_subplot(grid[r, :] if panel["gridPos"]["w"] >= 24 else grid[r, c])
            ax.set_title(panel["title"], fontsize=10, loc="left")
            unit = panel["fieldConfig"]["defaults"].get("unit", "short")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_format(unit)))
            bars = panel["fieldConfig"]["defaults"]["custom"].get("drawStyle") == "bars"
            for fmt, labels, points in series.get(panel["id"], []):
                xs = [t - t0 for t, v in points if not math.isnan(v)]
                ys = [v for _, v in points if not math.isnan(v)]
                if bars:
                    ax.bar(xs, ys, width=1.0, label=legend(fmt, labels), alpha=0.7)
                else:
                    ax.plot(xs, ys, label=legend(fmt, labels), linewidth=1.2)
            # One line per event: an annotation query matches on every step of its window.
            starts = [t for t in sorted(set(annotations)) if t - 1 not in set(annotations)]
            for when in starts:
                ax.axvline(when - t0, color="orange", linestyle="--", linewidth=0.8)
            ax.set_xlabel("seconds into the run", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def substitute(expr: str, values: dict[str, str]) -> str:
    """A dashboard query with its variables ($namespace, $__rate_interval...) filled in."""
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def render_from_prometheus(board: dict[str, Any], prometheus_url: str, values: dict[str, str],
                           start: float, end: float, path: Path, step_s: float = 1.0) -> list[str]:
    """Range-query every panel of ``board`` (a dashboard's JSON) and its annotations from the
    Prometheus at ``prometheus_url`` over [start, end] (Unix seconds), draw them into ``path``;
    returns the titles of the panels that got no data."""
    import httpx

    def query(expr: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{prometheus_url}/api/v1/query_range", timeout=30, params={
            "query": substitute(expr, values), "start": start, "end": end, "step": step_s}).json()
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {expr!r}: {body}")
        return body["data"]["result"]

    series: dict[int, list[Series]] = {}
    empty = []
    for panel in board["panels"]:
        found = series.setdefault(panel["id"], [])
        for target in panel["targets"]:
            found += [(target["legendFormat"], s["metric"], [(float(t), float(v)) for t, v in s["values"]])
                      for s in query(target["expr"])]
        if not any(not math.isnan(v) for _, _, points in found for _, v in points):
            empty.append(panel["title"])
    annotations = [float(t) for a in board["annotations"]["list"] if "expr" in a
                   for s in query(a["expr"]) for t, v in s["values"] if float(v) > 0]
    render_dashboard(board["title"], board["panels"], series, annotations, start, path)
    return empty
