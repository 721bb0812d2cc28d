"""predicted-ttft's estimate calibrated on what this router measures: per replica, how the TTFTs it
saw compared with what it predicted.

The router proxies every request and sees the replica's first token arrive, so every streamed
request leaves one (predicted, measured) pair for the replica that answered it. The estimate
(``kvscale.router.policy.predicted_ttft``) misses two kinds of time:

- a cost every request pays whatever its work: the HTTP hop, the engine step already running when
  it arrives, being scheduled. It is the same on every replica (same engine, same code);
- a replica running slower or faster than its heartbeat's rates say: a neighbour on its node, a
  moving average that lags a change of load, a queue the heartbeat under-counts. It differs
  between replicas, and it is what can send a request to the wrong one.

So the calibrated estimate is

  ttft'(r) = overhead + scale(r) * ttft(r)

- ``overhead``: one figure for the pool, the intercept of a robust line through every replica's
  recent pairs (measured against predicted), at least 0.
- ``slowdown(r)``: over r's last WINDOW pairs, sum(measured - overhead) / sum(predicted). A ratio
  of sums weighs each pair by its prediction, so the many short cache hits (where the overhead is
  all there is) do not decide it; a ratio per pair would make every holder of a hot prefix look
  slow, and the spill rule would spread its prefixes.
- ``scale(r)``: only the differences between replicas change a decision, and a correction that made
  a holder look slower than it is would spread its prefixes. So a replica's slowdown is used
  relative to the pool's median, held within CALIBRATION_SPREAD of it (as RATE_SPREAD holds the
  measured rates), times the median. A replica with fewer than MIN_PAIRS pairs takes the median:
  neither shunned nor flooded until it has been measured.

Everything but ``TtftCalibration`` (the per-replica windows) is a pure function.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Pairs kept per replica: about the last half minute of a busy replica's requests.
WINDOW = 32
# Fewer pairs than this say too little about a replica: it takes the pool's median.
MIN_PAIRS = 8
# A replica's slowdown is believed within this factor of the pool's median.
CALIBRATION_SPREAD = 2.0
# The overhead is fitted only when the longer half of the predictions is this much longer than
# the shorter half (otherwise an intercept and a slope cannot be told apart).
OVERHEAD_MIN_SPREAD = 1.5
# A pool median outside these bounds says the pairs are wrong (a clock jump), not the estimate.
SLOWDOWN_BOUNDS = (0.1, 20.0)
# Recomputed after this many new pairs: a recomputation sorts every replica's window (about 0.1 ms
# for 3 replicas here), too much for every request of a large pool, and one pair moves little.
RECOMPUTE_EVERY = 8


@dataclass(frozen=True)
class Calibration:
    """What the policy applies: ttft'(r) = overhead_s + scales[r] * ttft(r)."""

    overhead_s: float = 0.0
    scales: dict[str, float] = field(default_factory=dict)  # replica id -> scale; absent: 1.0

    def scale(self, replica_id: str) -> float:
        return self.scales.get(replica_id, 1.0)


NONE = Calibration()


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def pool_overhead(pairs: Iterable[tuple[float, float]]) -> float:
    """The time every request pays beyond its predicted work: the intercept of the line through the
    pool's (predicted, measured) pairs, fitted robustly (split at the median prediction, a line
    through each half's medians: a minority of late requests, a queue the estimate missed, moves
    it little). 0 while there are fewer than MIN_PAIRS pairs, when the predictions are too alike
    to tell an intercept from a slope, or when the line says less than nothing."""
    ordered = sorted(pairs)
    if len(ordered) < MIN_PAIRS:
        return 0.0
    low, high = ordered[: len(ordered) // 2], ordered[len(ordered) // 2:]
    p_low, m_low = statistics.median(p for p, _ in low), statistics.median(m for _, m in low)
    p_high, m_high = statistics.median(p for p, _ in high), statistics.median(m for _, m in high)
    if p_high < OVERHEAD_MIN_SPREAD * p_low:
        return 0.0
    slope = (m_high - m_low) / (p_high - p_low)
    return min(max(m_low - max(slope, 0.0) * p_low, 0.0), m_low)


def slowdown(pairs: Sequence[tuple[float, float]], overhead_s: float) -> float | None:
    """How much longer than predicted a replica's requests took, the overhead aside (a ratio of
    sums); None with fewer than MIN_PAIRS pairs."""
    if len(pairs) < MIN_PAIRS:
        return None
    predicted = sum(p for p, _ in pairs)
    if predicted <= 0:
        return None
    return max(sum(m - overhead_s for _, m in pairs), 0.0) / predicted


def pool_scales(slowdowns: dict[str, float | None]) -> dict[str, float]:
    """Each replica's scale: the pool's median slowdown times the replica's own relative to it,
    held within CALIBRATION_SPREAD; unmeasured replicas (None) take the median. All 1.0 when no
    replica is measured or the median is out of SLOWDOWN_BOUNDS."""
    measured = [s for s in slowdowns.values() if s is not None]
    if not measured:
        return dict.fromkeys(slowdowns, 1.0)
    median = statistics.median(measured)
    if not SLOWDOWN_BOUNDS[0] <= median <= SLOWDOWN_BOUNDS[1]:
        return dict.fromkeys(slowdowns, 1.0)
    low, high = median / CALIBRATION_SPREAD, median * CALIBRATION_SPREAD
    return {rid: median if s is None else min(max(s, low), high) for rid, s in slowdowns.items()}


def calibration(windows: Mapping[str, Sequence[tuple[float, float]]], replica_ids: Iterable[str]) -> Calibration:
    """The calibration for a decision among ``replica_ids`` from every replica's pairs."""
    overhead = pool_overhead(pair for pairs in windows.values() for pair in pairs)
    return Calibration(overhead, pool_scales(
        {rid: slowdown(windows.get(rid, ()), overhead) for rid in replica_ids}))


class TtftCalibration:
    """Each replica's last WINDOW (predicted, measured) pairs, in seconds. Only the router's event
    loop touches it."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._pairs: dict[str, deque[tuple[float, float]]] = {}
        self._cached: tuple[tuple[str, ...], Calibration] | None = None
        self._new = 0  # pairs observed since the cached calibration was computed

    def observe(self, replica_id: str, predicted_s: float, measured_s: float) -> None:
        if predicted_s <= 0 or measured_s < 0:
            return
        self._pairs.setdefault(replica_id, deque(maxlen=self.window)).append((predicted_s, measured_s))
        self._new += 1

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet."""
        if self._pairs.pop(replica_id, None) is not None:
            self._cached = None

    def pairs(self, replica_id: str) -> list[tuple[float, float]]:
        return list(self._pairs.get(replica_id, ()))

    def current(self, replica_ids: Sequence[str]) -> Calibration:
        """Recomputed after RECOMPUTE_EVERY new pairs, or for another set of replicas."""
        key = tuple(replica_ids)
        if self._cached is None or self._cached[0] != key or self._new >= RECOMPUTE_EVERY:
            self._cached = (key, calibration(self._pairs, key))
            self._new = 0
        return self._cached[1]
