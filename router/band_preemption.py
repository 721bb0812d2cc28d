"""Whether a request waiting in the router's queue goes to a full replica anyway, as a pure
decision (docs/router.md, "Fair share when the fleet is saturated").

Replicas under ``--scheduling-policy priority`` preempt a running request for a waiting one of a
strictly more urgent priority (docs/engine.md, "Priority scheduling"). Holding such a request in
the router until a less urgent one ends would undo that: it would wait the length of a request
it outranks. So, when the router is told the replicas run ``priority``, a waiting request is let
through without room while there are more less urgent sequences to displace than this router has
let through so (each one let through displaces one of them).

Those to displace are the larger of two counts: this router's own requests open in less urgent
bands, and the less urgent sequences the candidate replicas' heartbeats say they run (every
router's, a heartbeat period old). Without the second, a router whose own requests had all ended
held an urgent request while another router's less urgent ones filled the replicas: that router
refills a slot within a loop turn of each finish, so a heartbeat rarely showed one free, and the
urgent request waited up to a second. A displacement shows in a later heartbeat as one fewer less
urgent sequence while it is still counted as let through: that errs towards holding. Routers do
not share their counts, so each may send one request per sequence the heartbeats show: those past
what the replica displaces wait in its queue, ahead of the less urgent ones, as they would have
waited in the router.
"""

from __future__ import annotations

from collections.abc import Mapping

NO_SEQUENCES: Mapping[int, int] = {}


def may_preempt(band: int, open_by_band: Mapping[int, int], open_let_through_without_room: int,
                running_by_priority: Mapping[int, int] = NO_SEQUENCES) -> bool:
    """Whether a request of ``band`` is let through although its replicas have no room.

    ``open_by_band``: this router's requests let through and not ended, by band;
    ``open_let_through_without_room``: how many of them were let through so;
    ``running_by_priority``: the sequences the candidate replicas run, by priority, summed over
    their heartbeats (the band is the priority the replicas are sent: router/engine_priority.py).
    """
    own = sum(count for other, count in open_by_band.items() if other > band)
    fleet = sum(count for level, count in running_by_priority.items() if level > band)
    return max(own, fleet) > open_let_through_without_room
