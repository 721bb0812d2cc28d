"""Whether a request waiting in the router's queue goes to a full replica anyway, as a pure
decision (docs/router.md, "Fair share when the fleet is saturated").

Replicas under ``--scheduling-policy priority`` preempt a running request for a waiting one of a
strictly more urgent priority (docs/engine.md, "Priority scheduling"). Holding such a request in
the router until a less urgent one ends would undo that: it would wait the length of a request
it outranks. So, when the router is told the replicas run ``priority``, a waiting request is let
through without room while this router has more requests open in less urgent bands than it has
let through so (each one let through displaces one of them). A router counts only its own open
requests: the other routers' show in the heartbeats' room, never in these counts.
"""

from __future__ import annotations

from collections.abc import Mapping


def may_preempt(band: int, open_by_band: Mapping[int, int], open_let_through_without_room: int) -> bool:
    """Whether a request of ``band`` is let through although its replicas have no room.

    ``open_by_band``: this router's requests let through and not ended, by band;
    ``open_let_through_without_room``: how many of them were let through so.
    """
    less_urgent = sum(count for other, count in open_by_band.items() if other > band)
    return less_urgent > open_let_through_without_room
