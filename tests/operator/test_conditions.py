"""Conditions as the Kubernetes API conventions describe them."""

from __future__ import annotations

import datetime as dt

from kvscale.operator.conditions import (
    PROGRESSING,
    READY,
    Condition,
    find_condition,
    merge_conditions,
    transitions,
)

T0 = dt.datetime(2026, 11, 22, 10, 0, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)


def test_last_transition_time_moves_only_when_status_changes():
    first = merge_conditions(None, [Condition(READY, False, "PodsNotReady", "0/1")], 1, T0)
    assert first == [{"type": "Ready", "status": "False", "reason": "PodsNotReady",
                      "message": "0/1", "observedGeneration": 1,
                      "lastTransitionTime": "2026-11-22T10:00:00Z"}]
    # Same status, new reason and generation: the transition time stays.
    second = merge_conditions(first, [Condition(READY, False, "Unschedulable", "no GPU")], 2, T1)
    ready = find_condition(second, READY)
    assert ready["reason"] == "Unschedulable" and ready["observedGeneration"] == 2
    assert ready["lastTransitionTime"] == "2026-11-22T10:00:00Z"
    third = merge_conditions(second, [Condition(READY, True, "Serving", "1/1")], 2, T1)
    assert find_condition(third, READY)["lastTransitionTime"] == "2026-11-22T10:05:00Z"


def test_merge_keeps_unmentioned_conditions_and_orders_them():
    existing = merge_conditions(None, [Condition("ScalingActive", True, "Stable")], 1, T0)
    merged = merge_conditions(existing, [Condition(READY, True, "Serving"),
                                         Condition(PROGRESSING, None, "Unknown")], 1, T1)
    assert [c["type"] for c in merged] == ["Ready", "Progressing", "ScalingActive"]
    assert find_condition(merged, PROGRESSING)["status"] == "Unknown"


def test_transitions_report_status_or_reason_changes_only():
    existing = merge_conditions(None, [Condition(READY, False, "PodsNotReady")], 1, T0)
    assert transitions(existing, [Condition(READY, False, "PodsNotReady", "new text")]) == []
    changed = transitions(existing, [Condition(READY, False, "Unschedulable")])
    assert [c.reason for c in changed] == ["Unschedulable"]
