"""A tenant's priority sent to the replicas as each request's ``priority`` field, when they run
``--scheduling-policy priority`` and the router is told so (docs/router.md, "Priority on the
replicas"), as pure decisions.

The field sent is the request's band (fair_share.band): its tenant's ``priority``, or the
request's own when that is a less urgent integer, so a tenant's clients cannot jump the
replicas' queues past what their tenant was given. A value the engine would refuse (not an
integer, beyond its bound) is left as the client wrote it, for the replica's 400 to say why.
Under ``fcfs`` the replicas refuse any priority but 0, so the router sends none of its own.
"""

from __future__ import annotations

import json
from typing import Any

from kvscale.router.fair_share import PRIORITY_BOUND, band

SCHEDULING_POLICIES = ("fcfs", "priority")


def _valid(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and abs(value) <= PRIORITY_BOUND)


def forwarded_priority(tenant_priority: int, body: dict[str, Any]) -> int | None:
    """The ``priority`` to send in place of the body's; None: the body goes as it is."""
    if "priority" not in body or body["priority"] is None:
        return tenant_priority if tenant_priority != 0 else None
    requested = body["priority"]
    if not _valid(requested):
        return None
    sent = band(tenant_priority, requested)
    return sent if sent != requested else None


def with_priority(body: dict[str, Any], priority: int) -> bytes:
    """The request's JSON with ``priority`` set (the other fields as parsed)."""
    return json.dumps({**body, "priority": priority}, separators=(",", ":")).encode()
