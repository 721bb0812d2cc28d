"""Order statistics of a benchmark's samples: the quantiles and the p50 / p99 / mean summary that
the benchmarks report (docs/performance.md states each figure as such a quantile)."""

from __future__ import annotations

import statistics


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def nearest_rank(values: list[float], q: float) -> float | None:
    """The sample at rank ``q x n`` (no interpolation: a figure some sample really took); None for
    no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    """p50, p99 (interpolated) and mean; NaN for no values."""
    return {"p50": quantile(values, 0.5), "p99": quantile(values, 0.99),
            "mean": statistics.fmean(values) if values else float("nan")}
