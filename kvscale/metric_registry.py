"""One way to turn a metric's contract (kvscale.metric_names) into a prometheus_client object."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvscale.metric_names import COUNTER, GAUGE, HISTOGRAM, Metric


def register(metric: Metric, registry: CollectorRegistry, buckets: tuple[float, ...] | None = None) -> Any:
    """The Counter, Gauge or Histogram ``metric`` names, with its help and labels, in ``registry``.

    Histograms need their ``buckets`` (a choice of the part that observes them); the other types
    refuse them, so a contract's type and its use cannot disagree.
    """
    if metric.type == HISTOGRAM:
        if buckets is None:
            raise ValueError(f"{metric.name} is a histogram: give its buckets")
        return Histogram(metric.name, metric.help, list(metric.labels), buckets=buckets, registry=registry)
    if buckets is not None:
        raise ValueError(f"{metric.name} is a {metric.type}: it has no buckets")
    kinds = {COUNTER: Counter, GAUGE: Gauge}
    return kinds[metric.type](metric.name, metric.help, list(metric.labels), registry=registry)
