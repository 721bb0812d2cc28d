"""Every request opened on a replica is counted there until closed, and its prefill ledger entry
follows it, even when the replica's id changes meanwhile."""

from __future__ import annotations

from kvscale.router.in_flight import InFlight
from kvscale.router.metrics import RouterMetrics
from kvscale.router.replicas import Replica


def test_open_and_close_keep_the_count_the_gauge_and_the_ledger() -> None:
    metrics = RouterMetrics()
    in_flight = InFlight(metrics.in_flight)
    replica = Replica("http://h:1", "h:1")
    first, second = in_flight.open(replica, 100), in_flight.open(replica, 7)
    assert replica.in_flight == 2 and metrics.in_flight.labels("h:1")._value.get() == 2
    ledger = in_flight.ledger("h:1")
    assert ledger is not None and sorted(s.tokens for s in ledger.open.values()) == [7, 100]
    first.first_byte()
    replica.replica_id = "replica-0"  # its first heartbeat binds its id mid-request
    in_flight.close(first)
    in_flight.close(second)
    assert replica.in_flight == 0 and replica.last_finished > 0
    assert ledger.open == {}
    # The started request stays a while (a heartbeat may still count it); the other is gone.
    assert [s.tokens for s in ledger.entries(replica.last_finished)] == [100]
