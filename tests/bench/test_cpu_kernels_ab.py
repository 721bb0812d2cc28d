"""The pure part of bench/cpu_kernels_ab.py: medians over rounds and before ÷ after per op."""

from __future__ import annotations

import pytest

from bench.cpu_kernels_ab import summarize


def rows(w1: float, w2: float) -> list[dict]:
    return [{"op": "prefill attention, W1", "c_ms": w1}, {"op": "prefill attention, W2", "c_ms": w2}]


def test_summary_is_each_sides_median_over_rounds_and_their_ratio() -> None:
    rounds = [{"before": rows(2.0, 9.0), "after": rows(1.0, 3.0)},
              {"before": rows(4.0, 6.0), "after": rows(2.0, 4.0)},
              {"before": rows(3.0, 3.0), "after": rows(9.0, 2.0)}]
    summary = summarize(rounds)
    assert summary["prefill attention, W1"] == {"before_c_ms": 3.0, "after_c_ms": 2.0, "before_over_after": 1.5}
    assert summary["prefill attention, W2"]["before_over_after"] == pytest.approx(6.0 / 3.0)
