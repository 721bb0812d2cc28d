"""predicted-ttft's estimate calibrated on measured TTFTs: the pure functions, what they change in
a decision, and the measurement the forwarder hands them (on plain values and in-memory parts)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import Gauge

from kvscale.router import policy
from kvscale.router.in_flight import InFlight
from kvscale.router.policy import Candidate
from kvscale.router.replicas import Replica
from kvscale.router.ttft_calibration import (
    CALIBRATION_SPREAD,
    MIN_PAIRS,
    RECOMPUTE_EVERY,
    Calibration,
    TtftCalibration,
    calibration,
    pool_overhead,
    pool_scales,
    slowdown,
)


def pairs(predicted: list[float], slow: float, overhead: float = 0.0) -> list[tuple[float, float]]:
    return [(p, overhead + slow * p) for p in predicted]


def test_the_overhead_is_the_intercept_of_a_robust_line_and_never_negative() -> None:
    # Every request pays 0.2 s, and the machine runs 3x slower than predicted: intercept, not error.
    assert pool_overhead(pairs([0.1, 0.5, 1.0, 2.0] * 6, 3.0, overhead=0.2)) == pytest.approx(0.2)
    # A sixth of them also waited 3 s behind a queue the estimate missed: it moves little.
    clean = pairs([0.1, 0.5, 1.0, 2.0] * 6, 1.0, overhead=0.2)
    late = [(p, m + 3.0) for p, m in clean[:4]]
    assert 0.2 <= pool_overhead(clean[4:] + late) < 0.35
    assert pool_overhead(pairs([0.1, 1.0] * 5, 0.5)) == 0.0  # over-estimates: no negative overhead
    assert pool_overhead(pairs([0.5] * 10, 1.0, overhead=1.0)) == 0.0  # all alike: a slope, not an intercept
    assert pool_overhead(pairs([0.1, 1.0] * 3, 1.0, overhead=1.0)) == 0.0  # too few to say


def test_slowdown_is_a_ratio_of_sums_net_of_the_overhead() -> None:
    assert slowdown(pairs([0.1, 1.0, 3.0] * 3, 2.0, overhead=0.3), 0.3) == pytest.approx(2.0)
    assert slowdown(pairs([1.0] * (MIN_PAIRS - 1), 2.0), 0.0) is None
    # Short hits whose time is mostly overhead: per pair they would read 0.35 / 0.05 = 7x slow;
    # the ratio of sums, net of the overhead, says the replica runs at its predicted speed.
    hits = pairs([0.05] * 6 + [2.0] * 2, 1.0, overhead=0.3)
    assert slowdown(hits, 0.3) == pytest.approx(1.0)


def test_scales_are_relative_to_the_pools_median_and_held_within_the_spread() -> None:
    scales = pool_scales({"a": 1.5, "b": 1.5, "c": 1.5 * 5, "d": None})
    assert scales["a"] == scales["b"] == scales["d"] == pytest.approx(1.5)  # "d": unmeasured, the median
    assert scales["c"] == pytest.approx(1.5 * CALIBRATION_SPREAD)  # 5x slower is believed as 2x
    assert pool_scales({"a": None, "b": None}) == {"a": 1.0, "b": 1.0}
    assert pool_scales({"a": 500.0, "b": 400.0}) == {"a": 1.0, "b": 1.0}  # a clock jump, not a slowdown


def test_a_slowdown_common_to_every_replica_changes_no_decision() -> None:
    """The whole machine runs 3x slower than its heartbeats say and every request pays 0.4 s more:
    the calibrated estimates are higher, but every ranking is the one the raw estimates gave."""
    windows = {rid: pairs([0.05, 0.3, 0.6, 1.2] * 4, 3.0, overhead=0.4) for rid in ("h", "a", "b")}
    cal = calibration(windows, ["h", "a", "b"])
    assert cal.overhead_s == pytest.approx(0.4)
    assert all(cal.scale(rid) == pytest.approx(3.0) for rid in ("h", "a", "b"))
    fleets = [
        [Candidate("h", 1, matched_blocks=32, queued_prefill_tokens=q, prefill_tokens_per_s=1000.0),
         Candidate("a", 1, queued_prefill_tokens=a, prefill_tokens_per_s=1000.0),
         Candidate("b", 0, prefill_tokens_per_s=800.0)]
        for q in (0, 500, 1000, 1300, 2000, 4000) for a in (0, 300, 900)
    ]
    for fleet in fleets:
        raw = policy.predicted_ttft_policy(fleet, 528, 16, hash_key=1)
        scaled = [Candidate(**{**c.__dict__, "ttft_scale": cal.scale(c.replica_id)}) for c in fleet]
        calibrated = policy.predicted_ttft_policy(scaled, 528, 16, hash_key=1, ttft_overhead_s=cal.overhead_s)
        assert calibrated.ranked[0] == raw.ranked[0]
        assert calibrated.predicted_ttft_s == pytest.approx(0.4 + 3.0 * raw.predicted_ttft_s)
        assert calibrated.uncalibrated_ttft_s == pytest.approx(raw.predicted_ttft_s)


def test_a_holder_measured_slower_than_the_others_spills_sooner_and_no_further_than_the_spread() -> None:
    """The holder's queue looks like 1.0 s against 0.528 + 0.512 s saved on an idle replica: kept,
    raw. Measured 1.6x slower than the others (a neighbour on its node) it is truly overloaded.
    Measured 10x slower it is still believed at most CALIBRATION_SPREAD x."""
    holder = Candidate("h", 1, matched_blocks=32, queued_prefill_tokens=1000, prefill_tokens_per_s=1000.0)
    idle = Candidate("i", 0, prefill_tokens_per_s=1000.0)
    assert policy.predicted_ttft_policy([holder, idle], 528, 16, hash_key=1).ranked[0] == "h"
    for slow, spills in ((1.6, True), (1.1, False)):
        cal = pool_scales({"h": slow, "i": 1.0, "j": 1.0})
        fleet = [Candidate(**{**c.__dict__, "ttft_scale": cal[c.replica_id]}) for c in (holder, idle)]
        assert (policy.predicted_ttft_policy(fleet, 528, 16, hash_key=1).ranked[0] == "i") is spills
    assert pool_scales({"h": 10.0, "i": 1.0, "j": 1.0})["h"] == CALIBRATION_SPREAD


def test_short_hits_on_a_holder_do_not_make_it_look_slow() -> None:
    """A holder serving hits (0.05 s predicted, 0.35 s measured: all overhead) beside replicas doing
    cold prefills (1-2 s predicted, measured that plus the overhead): its scale stays the pool's."""
    windows = {"h": pairs([0.05] * 16, 1.0, overhead=0.3),
               "a": pairs([1.0, 2.0] * 8, 1.0, overhead=0.3),
               "b": pairs([1.5, 1.0] * 8, 1.0, overhead=0.3)}
    cal = calibration(windows, ["h", "a", "b"])
    assert cal.overhead_s == pytest.approx(0.3)
    assert cal.scale("h") == pytest.approx(cal.scale("a")) == pytest.approx(1.0)


def test_the_store_keeps_a_window_per_replica_and_forgets_a_replica_that_left() -> None:
    store = TtftCalibration(window=10)
    for _ in range(12):
        store.observe("a", 0.5, 1.0)
        store.observe("b", 0.5, 0.5)
    store.observe("a", 0.0, 1.0)  # no prediction: nothing to learn
    assert len(store.pairs("a")) == 10
    cal = store.current(["a", "b"])
    assert cal.scale("a") == pytest.approx(2 * cal.scale("b"))
    for _ in range(RECOMPUTE_EVERY - 1):
        store.observe("b", 0.5, 1.0)
    assert store.current(["a", "b"]) is cal  # a few new pairs move little: not recomputed yet
    store.observe("b", 0.5, 1.0)
    assert store.current(["a", "b"]).scale("b") > cal.scale("b")
    store.forget("a")
    after = store.current(["a", "b"])
    assert store.pairs("a") == [] and after.scale("a") == pytest.approx(after.scale("b"))  # the median
    assert Calibration().scale("x") == 1.0


def test_the_measurement_is_the_time_from_sending_to_the_first_token_once() -> None:
    in_flight = InFlight(Gauge("test_calibration_in_flight", "in flight", ["replica"], registry=None))
    replica = Replica("http://r", "r", healthy=True)
    measured: list[float] = []
    request = in_flight.open(replica, 100, measured.append)
    time.sleep(0.02)
    request.first_byte()
    request.first_byte()  # every later chunk: measured once
    in_flight.close(request)
    assert len(measured) == 1 and 0.02 <= measured[0] < 1.0


def test_only_estimates_from_a_replicas_own_measured_rate_teach_the_calibration() -> None:
    """A replica that has not measured itself borrows a rate: its estimate's error says nothing of
    it (a fresh pool's first requests ran 6x their estimate on the default rate), so the decision
    says so and the forwarder keeps no pair for it; nor for a response that does not stream."""
    from kvscale.router.proxy import Forwarder, Routed

    fresh = Candidate("fresh", 0)
    measured = Candidate("measured", 3, queued_prefill_tokens=4000, prefill_tokens_per_s=500.0)
    assert not policy.predicted_ttft_policy([fresh, measured], 528, 16, hash_key=1).rate_measured
    assert policy.predicted_ttft_policy([measured], 528, 16, hash_key=1).rate_measured
    store = TtftCalibration()
    forwarder = Forwarder(1.0, "predicted-ttft", None, None, None, None, None, store)  # type: ignore[arg-type]
    replica = Replica("http://r", "r", healthy=True)
    base = dict(endpoint="completions", body=b"", headers={}, ranked=[replica], hashes=[], prompt_tokens=528,
                predicted_hit_tokens=0, session=None, router_ms=0.1, predicted_ttft_s=0.5, uncalibrated_ttft_s=0.5)
    assert forwarder._measure(Routed(**base, calibrates=False), replica) is None
    observe = forwarder._measure(Routed(**base, calibrates=True), replica)
    assert observe is not None
    observe(0.9)
    assert store.pairs("r") == [(0.5, 0.9)]
