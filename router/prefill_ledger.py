"""This router's own in-flight token accounting per replica, corrected when a heartbeat catches up.

A replica's heartbeat says how many prompt tokens wait for prefill there, but it is up to a second
old. Between heartbeats this router knows what it sent since (not in the heartbeat yet) and which
of the requests the heartbeat counted have started streaming since (their prefill is done, so the
heartbeat over-counts them). ``queued_prefill_tokens`` combines the two; a pure function.

Only the router's event loop touches a ledger, so it has no locks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvscale.kv_index_schema import Heartbeat

# Prefill waits remembered per replica: a minute of a slow replica's requests.
RECENT_WAITS = 16


@dataclass
class Sent:
    tokens: int  # prompt tokens the replica must compute for it (prompt minus predicted hit)
    sent_at: float  # this router's monotonic clock, as is the heartbeat's time it is compared with
    started_at: float | None = None  # its first response byte: prefill done
    finished_at: float | None = None  # its end (it no longer decodes)


def queued_prefill_tokens(
    heartbeat_tokens: int | None, heartbeat_time: float, sent: Iterable[Sent]
) -> int:
    """Prompt tokens waiting for prefill on one replica, as best this router can tell.

    heartbeat's figure
      - tokens of our requests it counted (sent before it) that have started since
      + tokens of our requests sent after it that have not started.
    Without a heartbeat, our own unstarted requests are all we know.
    """
    unstarted_after = started_since = unstarted = 0
    for s in sent:
        if s.started_at is None:
            unstarted += s.tokens
            if s.sent_at > heartbeat_time:
                unstarted_after += s.tokens
        elif s.sent_at <= heartbeat_time < s.started_at:
            started_since += s.tokens
    if heartbeat_tokens is None:
        return unstarted
    return max(0, heartbeat_tokens - started_since) + unstarted_after


def decoding_count(
    heartbeat_decoding: int | None, heartbeat_time: float, sent: Iterable[Sent]
) -> int:
    """Sequences decoding on one replica: the heartbeat's count, less our requests that finished
    since it, plus ours that started since it. Without a heartbeat, ours that are decoding."""
    decoding_now = started_since = finished_since = 0
    for s in sent:
        if s.started_at is None:
            continue
        if s.finished_at is None:
            decoding_now += 1
            if s.started_at > heartbeat_time:
                started_since += 1
        elif s.started_at <= heartbeat_time < s.finished_at:
            finished_since += 1
    if heartbeat_decoding is None:
        return decoding_now
    return max(0, heartbeat_decoding - finished_since) + started_since


class PrefillLedger:
    """Requests this router sent to one replica, by a key of the caller's choosing.

    A finished request stays a little while (``keep_s``): a heartbeat taken before it started
    still counts its prompt as waiting, and only this entry can take it off again.
    """

    def __init__(self, keep_s: float = 5.0) -> None:
        self.open: dict[int, Sent] = {}
        self.keep_s = keep_s
        self._finished: dict[int, Sent] = {}
        # The last few prefill waits (sent to first byte): how long a prediction must live here.
        self._waits: deque[float] = deque(maxlen=RECENT_WAITS)

    def sent(self, key: int, tokens: int, now: float) -> None:
        self.open[key] = Sent(tokens, now)

    def started(self, key: int, now: float) -> None:
        entry = self.open.get(key)
        if entry is not None and entry.started_at is None:
            entry.started_at = now
            self._waits.append(now - entry.sent_at)

    def prefill_wait(self, now: float) -> float:
        """The longest of: the oldest open request's wait for its first byte so far, and the
        last RECENT_WAITS requests' waits (the index stretches its predictions to it)."""
        waiting = max((now - s.sent_at for s in self.open.values() if s.started_at is None), default=0.0)
        return max(waiting, max(self._waits, default=0.0))

    def done(self, key: int, now: float) -> None:
        entry = self.open.pop(key, None)
        if entry is not None and entry.started_at is not None:
            entry.finished_at = now
            self._finished[key] = entry

    def entries(self, now: float) -> list[Sent]:
        """Open requests, and finished ones recent enough that a heartbeat may still count them."""
        cutoff = now - self.keep_s
        stale = [k for k, s in self._finished.items()
                 if s.finished_at is not None and s.finished_at < cutoff]
        for key in stale:
            del self._finished[key]
        return [*self.open.values(), *self._finished.values()]


def ttft_inputs(
    heartbeat: Heartbeat | None, ledger: PrefillLedger | None, now: float, heartbeat_time: float
) -> dict[str, Any]:
    """The predicted-ttft fields of a policy Candidate, from a replica's heartbeat (or None) and
    this router's ledger for it (or None). ``now`` and ``heartbeat_time`` (when the heartbeat was
    taken) are on the ledger's clock, this router's monotonic one."""
    sent = ledger.entries(now) if ledger is not None else []
    if heartbeat is None:
        return {"queued_prefill_tokens": queued_prefill_tokens(None, 0.0, sent),
                "num_decoding": decoding_count(None, 0.0, sent)}
    return {
        "queued_prefill_tokens": queued_prefill_tokens(
            heartbeat.prefill_tokens_waiting, heartbeat_time, sent),
        "num_decoding": decoding_count(heartbeat.num_decoding, heartbeat_time, sent),
        "prefill_tokens_per_s": heartbeat.prefill_tokens_per_s,
        "decode_step_s": heartbeat.decode_step_s,
        "step_token_budget": heartbeat.step_token_budget,
    }
