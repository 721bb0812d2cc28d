"""Fair share between tenants waiting in the router, as pure decisions: priority bands first, then
a weighted Virtual Token Counter (VTC, Sheng et al., OSDI'24) within a band (docs/router.md,
"Fair share when the fleet is saturated").

Each tenant has a counter of the tokens it was served, each divided by its weight. When a slot
frees up, the waiting tenant in the most urgent band (the lowest priority value, vLLM's
convention) with the smallest counter goes next, the one with the oldest waiting request among
equals. A tenant that starts waiting has its counter lifted to the smallest counter among those
already waiting (or, when none waits, to the last one served), so a tenant idle for an hour
does not bank an hour of credit and then starve the others; this lift is what bounds the gap in
service between two backlogged tenants of equal weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# vLLM's bound on a request's priority field; the engine refuses values beyond it.
PRIORITY_BOUND = 2**31


def band(tenant_priority: int, requested: Any) -> int:
    """The band a request waits in: its own ``priority`` field when it is a valid int no more
    urgent than its tenant's, else its tenant's. A client may lower its urgency, never raise it
    above what its tenant was given."""
    if isinstance(requested, bool) or not isinstance(requested, int):
        return tenant_priority
    if abs(requested) > PRIORITY_BOUND:
        return tenant_priority
    return max(tenant_priority, requested)


def charged(counter: float, tokens: int, weight: float) -> float:
    """A counter after its tenant was served ``tokens`` (negative: a reservation given back)."""
    return counter + tokens / weight


def lifted(counter: float, waiting_counters: Iterable[float], last_served: float) -> float:
    """The counter of a tenant that starts waiting: at least the smallest of those already
    waiting, or the last served's when none is."""
    floor = min(waiting_counters, default=last_served)
    return max(counter, floor)


def dispatch_order(heads: Mapping[str, tuple[int, int]],
                   counters: Mapping[str, float]) -> list[str]:
    """The waiting tenants in the order they get the next free slot.

    ``heads``: each waiting tenant's (band, arrival number of its oldest waiting request);
    ``counters``: their virtual token counters (absent: 0). The most urgent band first; within
    one, the smallest counter, then the oldest request.
    """
    return sorted(heads, key=lambda t: (heads[t][0], counters.get(t, 0.0), heads[t][1]))


def pruned(counters: Mapping[str, float], waiting: Iterable[str],
           floor: float) -> dict[str, float]:
    """The counters worth keeping: those of waiting tenants, and those above ``floor`` (a tenant
    that is not waiting and at or below it would be lifted to it anyway when it comes back), so
    the table holds no more than the tenants that matter now."""
    keep = set(waiting)
    return {t: c for t, c in counters.items() if t in keep or c > floor}
