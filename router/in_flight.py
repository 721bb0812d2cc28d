"""The requests this router has open on each replica: counts for the load, ledgers for the TTFT.

Every attempt to send a request opens an entry here and closes it exactly once: when the attempt
fails, or when the response it streams ends. A replica's in-flight count and its last finish
time feed the policy's load; its prefill ledger feeds the predicted-TTFT inputs.

Times are this router's monotonic clock; heartbeats are brought onto it before they are compared
(``HeartbeatTable.local_time``). Only the router's event loop touches this, so it has no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Gauge

from kvscale.router.prefill_ledger import PrefillLedger
from kvscale.router.replicas import Replica


@dataclass
class OpenRequest:
    replica: Replica
    # The ledger itself, not a lookup by replica id: the id changes when the replica's first
    # heartbeat binds it (a router that just started), and the lookup then lost the entry.
    ledger: PrefillLedger
    key: int
    sent_at: float = 0.0  # this router's monotonic clock when it was sent
    # Told the seconds from sending to the first token, once (the TTFT calibration's measurement).
    on_started: Callable[[float], None] | None = None

    def first_byte(self) -> None:
        """Its response started: its prefill is done."""
        now = time.monotonic()
        self.ledger.started(self.key, now)
        if self.on_started is not None:
            on_started, self.on_started = self.on_started, None
            on_started(now - self.sent_at)


class InFlight:
    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge  # kvscale_router_in_flight, by replica id
        self._ledgers: dict[str, PrefillLedger] = {}  # replica id -> our requests there
        self._keys = 0

    def ledger(self, replica_id: str) -> PrefillLedger | None:
        return self._ledgers.get(replica_id)

    def open(self, replica: Replica, prefill_tokens: int,
             on_started: Callable[[float], None] | None = None,
             hashes: Sequence[int] = (), prompt_tokens: int = 0) -> OpenRequest:
        """``prefill_tokens``: what the replica must compute for it (prompt less predicted hit);
        ``on_started`` is told the seconds from now to its first token; ``hashes`` (the prompt's
        full blocks) and ``prompt_tokens`` let the ledger tell a prefix the heartbeat counts once
        per waiting request sharing it (prefill_ledger.shared_prefix_tokens)."""
        replica.in_flight += 1
        self._keys += 1
        ledger = self._ledgers.setdefault(replica.replica_id, PrefillLedger())
        now = time.monotonic()
        ledger.sent(self._keys, prefill_tokens, now, hashes, prompt_tokens)
        self._gauge.labels(replica.replica_id).set(replica.in_flight)
        return OpenRequest(replica, ledger, self._keys, now, on_started)

    def close(self, request: OpenRequest) -> None:
        now = time.monotonic()
        request.ledger.done(request.key, now)
        replica = request.replica
        replica.in_flight -= 1
        replica.last_finished = now
        if self._ledgers.get(replica.replica_id) is request.ledger:
            # Not for a replica forgotten meanwhile: that would bring its series back.
            self._gauge.labels(replica.replica_id).set(replica.in_flight)

    def rename(self, old: str, new: str) -> None:
        """A heartbeat named the replica: its ledger (requests still open there) goes with it."""
        ledger = self._ledgers.pop(old, None)
        if ledger is not None and new not in self._ledgers:
            self._ledgers[new] = ledger

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet: its ledger goes (requests still open on it close quietly)."""
        self._ledgers.pop(replica_id, None)
