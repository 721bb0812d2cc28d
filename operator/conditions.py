"""Status conditions as the Kubernetes API conventions describe them.

Each condition has type, status ("True"/"False"/"Unknown"), a CamelCase reason, a human message,
the generation it was computed for, and lastTransitionTime, which moves only when status changes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

READY = "Ready"
PROGRESSING = "Progressing"
SCALING_ACTIVE = "ScalingActive"
SYNCED = "Synced"  # every child of the current generation applied
INFERENCE_POOL_READY = "InferencePoolReady"  # with spec.router.inferencePool (docs/gateway.md)


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""

    @property
    def status_text(self) -> str:
        return "Unknown" if self.status is None else ("True" if self.status else "False")


def now_rfc3339(now: dt.datetime | None = None) -> str:
    moment = now or dt.datetime.now(dt.UTC)
    return moment.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> dt.datetime:
    """A timestamp as now_rfc3339 writes it (the API's format), timezone-aware."""
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def merge_conditions(
    existing: list[dict[str, Any]] | None,
    updates: list[Condition],
    generation: int | None,
    now: dt.datetime | None = None,
    dropped: Collection[str] = (),
) -> list[dict[str, Any]]:
    """`existing` with `updates` applied; conditions not mentioned are kept as they are, but for
    the ``dropped`` types: the aspect they reported no longer exists (a feature turned off)."""
    stamp = now_rfc3339(now)
    merged = {c["type"]: dict(c) for c in existing or [] if "type" in c and c["type"] not in dropped}
    for update in updates:
        previous = merged.get(update.type)
        unchanged = previous is not None and previous.get("status") == update.status_text
        since = previous.get("lastTransitionTime", stamp) if previous and unchanged else stamp
        merged[update.type] = {
            "type": update.type,
            "status": update.status_text,
            "reason": update.reason,
            "message": update.message,
            "observedGeneration": generation if generation is not None else 0,
            "lastTransitionTime": since,
        }
    order = [READY, PROGRESSING, SCALING_ACTIVE]
    return sorted(merged.values(),
                  key=lambda c: (order.index(c["type"]) if c["type"] in order else len(order),
                                 c["type"]))


def find_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def transitions(
    existing: list[dict[str, Any]] | None, updates: list[Condition]
) -> list[Condition]:
    """Updates whose status or reason differ from what is recorded: each deserves an Event."""
    changed = []
    for update in updates:
        previous = find_condition(existing, update.type)
        if (previous is None or previous.get("status") != update.status_text
                or previous.get("reason") != update.reason):
            changed.append(update)
    return changed
