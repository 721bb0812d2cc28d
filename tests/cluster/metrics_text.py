"""Prometheus's text format read back in tests that scrape a pod's `/metrics`."""

from __future__ import annotations


def samples(text: str, series: str) -> dict[str, float]:
    """label text -> value, for every sample of ``series``."""
    found = {}
    for line in text.splitlines():
        if line.startswith(series + "{") or line.startswith(series + " "):
            head, value = line.rsplit(" ", 1)
            found[head[len(series):]] = float(value)
    return found
