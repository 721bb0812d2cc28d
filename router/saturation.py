"""Whether the replicas that could take a request have room for it now, from their own load, as
a pure decision (docs/router.md, "Fair share when the fleet is saturated").

A replica has room for as many more sequences as its batch holds (its heartbeat's
``max_num_seqs``) beyond those ahead there now (running and waiting, its heartbeat's count
corrected by this router's sends and finishes since: ``prefill_ledger.sequences_ahead``), and
never fewer than this router's own requests open there: one sent before the heartbeat was taken
may not have reached its engine yet (a front end slow to parse it on a loaded host), and the
heartbeat counts only the engine's. A
replica whose KV blocks are nearly all held has no room however few sequences it runs: a request
sent there would wait for blocks. A replica whose load the router does not know (no heartbeat,
or one from before heartbeats carried ``max_num_seqs``) makes the answer "unknown": the router
then never holds a request on a guess.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# KV blocks held beyond this fraction: the replica admits nothing more until some free.
KV_FULL = 0.95


@dataclass(frozen=True)
class ReplicaLoad:
    batch_slots: int  # the heartbeat's max_num_seqs (0: not published)
    sequences_ahead: int  # running and waiting there now, corrected by this router's sends
    kv_usage: float = 0.0  # KV blocks held / total
    own_open: int = 0  # this router's requests open there: ahead, whatever the heartbeat counts


def room(load: ReplicaLoad) -> int:
    """Sequences the replica can take now without any of them waiting."""
    ahead = max(load.sequences_ahead, load.own_open)
    if load.kv_usage >= KV_FULL and ahead > 0:
        return 0
    return max(0, load.batch_slots - ahead)


def free_slots(loads: Iterable[ReplicaLoad | None]) -> int | None:
    """The sequences the replicas can take now, over all of them; None when the load of any is
    unknown (``None``, or no ``batch_slots``)."""
    total = 0
    for load in loads:
        if load is None or load.batch_slots <= 0:
            return None
        total += room(load)
    return total
