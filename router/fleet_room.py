"""The room the replicas that could take a request have now, and what they run by priority: the
fair queue's inputs (router/fair_queue.py), read from their heartbeats and this router's own
sends and finishes since (docs/router.md, "Fair share when the fleet is saturated"). The
decisions on them are pure (router/saturation.py, router/band_preemption.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.in_flight import InFlight
from kvscale.router.prefill_ledger import sequences_ahead
from kvscale.router.replicas import Replica
from kvscale.router.saturation import ReplicaLoad, free_slots


def room_on(candidates: Iterable[Replica], heartbeats: HeartbeatTable,
            in_flight: InFlight) -> int | None:
    """The sequences the candidates can take now (saturation.free_slots), each one's heartbeat
    corrected by this router's sends and finishes since it was taken, and never below this
    router's requests open there."""
    now = time.monotonic()
    loads: list[ReplicaLoad | None] = []
    for replica in candidates:
        hb = heartbeats.get(replica.replica_id)
        if hb is None:
            loads.append(None)
            continue
        ledger = in_flight.ledger(replica.replica_id)
        sent = ledger.entries(now) if ledger is not None else []
        ahead = sequences_ahead(hb.load, heartbeats.local_time(hb), sent)
        loads.append(ReplicaLoad(hb.max_num_seqs, ahead, hb.kv_usage, replica.in_flight))
    return free_slots(loads)


def running_on(candidates: Iterable[Replica], heartbeats: HeartbeatTable) -> dict[int, int]:
    """The sequences the candidates run by priority, summed over their heartbeats
    (band_preemption.may_preempt's ``running_by_priority``)."""
    total: Counter[int] = Counter()
    for replica in candidates:
        hb = heartbeats.get(replica.replica_id)
        if hb is not None:
            total.update(hb.running_by_priority)
    return dict(total)
