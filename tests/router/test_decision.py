"""One decision's inputs gathered from the router's state: load from heartbeats and this router's
own requests, sticky sessions, and a stale index, on in-memory parts (no network)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.config import RouterConfig
from kvscale.router.decision import (
    Decider,
    GroupHomes,
    HotBlocks,
    SessionMemory,
    candidate_view,
    forget_stale_overloads,
    free_blocks,
    note_overload,
)
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.in_flight import InFlight
from kvscale.router.index import PrefixIndex
from kvscale.router.metrics import RouterMetrics
from kvscale.router.replicas import Replica


def beat(replica_id: str, running: int, timestamp: float, **extra: float) -> Heartbeat:
    return Heartbeat(replica_id, "m", f"http://{replica_id}", 16, running, 0, 3, 12, timestamp,
                     **extra)


def feed(beats: dict[str, Heartbeat], healthy: bool = True) -> SimpleNamespace:
    """Stands in for a RedisFeed: what the heartbeat table reads of it."""
    return SimpleNamespace(heartbeats=beats, healthy=healthy, healthy_since=time.monotonic())


def parts(
    policy: str = "prefix-affinity",
) -> tuple[Decider, HeartbeatTable, InFlight, RouterMetrics]:
    metrics = RouterMetrics(policy)
    heartbeats = HeartbeatTable()
    in_flight = InFlight(metrics.in_flight)
    config = RouterConfig(policy=policy, seed=0)
    decider = Decider(config, PrefixIndex(), heartbeats, in_flight, metrics)
    return decider, heartbeats, in_flight, metrics


def test_sessions_are_remembered_least_recently_used_first_out() -> None:
    sessions = SessionMemory(capacity=2)
    sessions.remember("a", "r1")
    sessions.remember("b", "r2")
    sessions.remember(None, "r3")  # no session header: nothing to remember
    assert sessions.get("a") == "r1"
    sessions.remember("a", "r2")  # "a" is now the most recent
    sessions.remember("c", "r1")
    assert (sessions.get("a"), sessions.get("b"), sessions.get("c")) == ("r2", None, "r1")
    assert sessions.get(None) is None


def test_a_candidates_load_is_ours_raised_by_a_heartbeat_newer_than_our_last_finish() -> None:
    _, heartbeats, in_flight, _ = parts()
    replica = Replica("http://r1", "r1", healthy=True)
    in_flight.open(replica, 100)
    wall = time.time()
    view = candidate_view(replica, 2, heartbeats, in_flight, wall)
    assert (view.load, view.kv_usage, view.matched_blocks) == (1, 0.0, 2)
    assert view.queued_prefill_tokens == 100  # ours, not started
    heartbeats.feed = feed({"r1": beat("r1", 5, wall, prefill_tokens_per_s=900.0)})
    view = candidate_view(replica, 2, heartbeats, in_flight, wall)
    assert (view.load, view.kv_usage, view.prefill_tokens_per_s) == (5, 0.25, 900.0)
    replica.last_finished = time.monotonic() + 1  # one of ours ended after the heartbeat was taken
    assert candidate_view(replica, 2, heartbeats, in_flight, time.monotonic()).load == 1


def test_a_replica_whose_clock_runs_ahead_does_not_make_an_old_heartbeat_look_new() -> None:
    """The replica's clock is 5 s ahead of the router's. Its heartbeat (5 in flight) was taken
    before our request there finished; compared with the replica's own clock it looked newer than
    that finish, so the stale load was believed. On the router's clock it is older: ignored."""
    _, heartbeats, in_flight, _ = parts()
    replica = Replica("http://r1", "r1", healthy=True)
    request = in_flight.open(replica, 100)
    skew = 5.0
    received = time.monotonic()
    hb = Heartbeat("r1", "m", "http://r1", 16, 5, 0, 3, 12, time.time() + skew, received=received)
    heartbeats.feed = feed({"r1": hb})
    assert candidate_view(replica, 0, heartbeats, in_flight, time.monotonic()).load == 5
    in_flight.close(request)  # ours finished after the heartbeat was taken and read
    in_flight.open(replica, 100)  # and another one is open
    view = candidate_view(replica, 0, heartbeats, in_flight, time.monotonic())
    assert view.load == 1  # ours: the heartbeat predates our finish
    # On the router's clock the heartbeat was taken no later than it was received.
    assert heartbeats.local_time(hb) <= received + 1e-6


def test_a_session_sticks_to_its_replica_and_the_prefix_holder_wins_otherwise() -> None:
    decider, _, _, _ = parts()
    replicas = [Replica(f"http://r{i}", f"r{i}", healthy=True) for i in range(3)]
    decider.index.stored("r2", [11, 12])
    assert decider.decide(replicas, [11, 12, 13], 11, None).ranked[0] == "r2"
    decider.sessions.remember("s", "r0")
    decision = decider.decide(replicas, [11, 12, 13], 11, "s")
    assert (decision.ranked[0], decision.reason) == ("r0", "sticky")


def test_a_stale_index_is_counted_and_spills_are_counted() -> None:
    decider, heartbeats, _, metrics = parts()
    replicas = [Replica(f"http://r{i}", f"r{i}", healthy=True) for i in range(2)]
    heartbeats.feed = feed({}, healthy=False)
    decider.decide(replicas, [], "key", None)
    assert metrics.fallbacks.labels("redis_down")._value.get() == 1
    heartbeats.feed = None
    decider.index.stored("r0", [1])
    replicas[0].in_flight = 10  # far over the bound: the holder is passed over
    assert decider.decide(replicas, [1], 1, None).ranked[0] == "r1"
    assert metrics.spills._value.get() == 1


def test_hot_blocks_are_the_room_reused_prefixes_take_and_expire() -> None:
    hot = HotBlocks(window_s=30.0)
    hot.sent("r0", [1, 2, 3], now=100.0)
    assert hot.footprint("r0", 101.0) == 0  # sent once: a unique prompt, or a prefix not reused yet
    hot.sent("r0", [1, 2, 4], now=120.0)
    assert hot.footprint("r0", 125.0) == 2  # blocks 1 and 2 were reused
    hot.sent("r0", [5], now=140.0)
    assert hot.footprint("r0", 151.0) == 0  # 1 and 2, last sent at 120, are no longer hot
    assert hot.footprint("r1", 140.0) == 0
    assert (free_blocks(10, 3), free_blocks(10, 12), free_blocks(0, 3)) == (7, 0, None)
    hot.sent("r0", [5], now=152.0)
    assert hot.footprint("r0", 152.0) == 1
    # Every distinct block sent within the window, once or more: the room recent traffic claims.
    assert hot.recent("r0", 152.0) == 1 and hot.recent("r1", 152.0) == 0  # 5 (4 expired at 150)
    hot.sent("r0", [6, 7, 6], now=153.0)
    assert hot.recent("r0", 153.0) == 3 and hot.recent("r0", 190.0) == 0
    hot.forget("r0")
    assert hot.footprint("r0", 152.0) == 0
    small = HotBlocks(window_s=30.0, capacity=2)  # the oldest hashes go first past the capacity
    small.sent("r0", [1, 2], now=0.0)
    small.sent("r0", [1, 2, 3], now=1.0)
    assert small.footprint("r0", 1.0) == 1  # 1 was pushed out; 2 (sent twice) is still hot


def test_the_default_places_a_cold_prompt_where_no_hot_prefix_is_evicted() -> None:
    """Two idle replicas of 12 KV blocks; r0 holds a hot 10-block prefix sent a moment ago. Cold
    4-block prompts go to r1 whatever their hash: placed on r0 they would evict the hot prefix."""
    decider, heartbeats, _, _ = parts("predicted-ttft")
    wall = time.time()
    heartbeats.feed = feed({rid: beat(rid, 0, wall, prefill_tokens_per_s=1000.0) for rid in ("r0", "r1")})
    replicas = [Replica(f"http://r{i}", f"r{i}", healthy=True) for i in range(2)]
    for _ in range(2):
        decider.hot.sent("r0", list(range(100, 110)), time.monotonic())
    chosen = {decider.decide(replicas, [200, 201, 202, 203], key, None, 64).ranked[0] for key in range(20)}
    assert chosen == {"r1"}


def test_a_replica_that_leaves_the_fleet_leaves_no_state_or_series_behind() -> None:
    """A fleet scaled 1 -> 4 -> 1: the three replicas discovery drops keep no index entries, ledger,
    heartbeat record, hot blocks or metric series; the one that stays keeps its own."""
    from prometheus_client import generate_latest

    from kvscale.router.replicas import ReplicaSet

    decider, heartbeats, in_flight, metrics = parts("predicted-ttft")
    fleet = ReplicaSet(on_removed=lambda replica: decider.forget(replica.replica_id))
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    fleet.set_urls(urls)
    wall = time.time()
    replicas = list(fleet.replicas.values())
    heartbeats.feed = feed({r.replica_id: beat(r.replica_id, 1, wall) for r in replicas})
    heartbeats.fold_into(fleet, {})
    open_requests = []
    for replica in replicas:
        decider.index.stored(replica.replica_id, [1, 2])
        for _ in range(2):
            decider.hot.sent(replica.replica_id, [1, 2], time.monotonic())
        open_requests.append(in_flight.open(replica, 100))
        for _ in range(8):
            decider.calibration.observe(replica.replica_id, 0.5, 1.0)
        metrics.requests.labels(replica.replica_id, "predicted-ttft", "200").inc()
    metrics.set_index_blocks(decider.index.sizes())
    gone = [r.replica_id for r in replicas[1:]]
    heartbeats.feed = feed({replicas[0].replica_id: beat(replicas[0].replica_id, 1, wall)})
    fleet.set_urls(urls[:1])
    for request in open_requests[1:]:
        in_flight.close(request)  # a stream that was still open on a dropped replica ends
    text = generate_latest(metrics.registry).decode()
    for replica_id in gone:
        assert f'replica="{replica_id}"' not in text
        assert in_flight.ledger(replica_id) is None
        assert replica_id not in decider.index.sizes()
        assert replica_id not in heartbeats._seen
        assert decider.hot.footprint(replica_id, time.monotonic()) == 0
        assert decider.calibration.pairs(replica_id) == []
    kept = replicas[0].replica_id
    assert f'replica="{kept}"' in text and in_flight.ledger(kept) is not None
    assert decider.index.sizes() == {kept: 2}


def test_a_replica_measured_slower_than_predicted_loses_a_close_call_when_calibration_decides() -> None:
    """r0 holds the prompt with 1,000 tokens queued (1.0 s at its rate) against an idle r1 (0.528 s
    plus 0.512 s saved): kept on the raw estimates. Its last requests took twice their predictions
    while r1's and r2's took what was predicted: deciding on the calibrated estimates
    (--ttft-calibration), r0 is truly overloaded."""
    for calibrated, expected in ((True, "r1"), (False, "r0")):  # --ttft-calibration, and the default
        decider, heartbeats, _, _ = parts("predicted-ttft")
        decider.config.ttft_calibration = calibrated
        wall = time.time()
        heartbeats.feed = feed({
            "r0": beat("r0", 1, wall, prefill_tokens_per_s=1000.0, prefill_tokens_waiting=1000),
            "r1": beat("r1", 0, wall, prefill_tokens_per_s=1000.0),
            "r2": beat("r2", 1, wall, prefill_tokens_per_s=1000.0, prefill_tokens_waiting=2000)})
        replicas = [Replica(f"http://r{i}", f"r{i}", healthy=True) for i in range(3)]
        hashes = list(range(1000, 1033))
        decider.index.stored("r0", hashes)
        for _ in range(8):
            decider.calibration.observe("r0", 0.5, 1.0)
            decider.calibration.observe("r1", 0.5, 0.5)
            decider.calibration.observe("r2", 0.5, 0.5)
        # No wait measured yet: an overload must outlast the predicted one; this one has (judged
        # overloaded since a minute ago, and a moment ago still).
        decider.overloaded_since["r0"] = time.monotonic() - 60.0
        decider.overload_seen["r0"] = time.monotonic() - 1.0
        decision = decider.decide(replicas, hashes, hashes[0], None, 528, 16)
        assert decision.ranked[0] == expected
        # Either way the estimate reported is the calibrated one: r0's raw estimate doubled, r1's as is.
        scale = 2.0 if expected == "r0" else 1.0
        assert decision.predicted_ttft_s == pytest.approx(scale * decision.uncalibrated_ttft_s)


def test_a_replica_renamed_by_its_first_heartbeat_leaves_no_series_under_its_old_name() -> None:
    """A pod is routed to under its address (host:port) before its first heartbeat names it
    (its pod name): the series, ledger and hot blocks kept under the address move to the name or
    go, so when discovery drops the pod nothing of it is left behind."""
    from prometheus_client import generate_latest

    from kvscale.router.replicas import ReplicaSet

    decider, heartbeats, in_flight, metrics = parts("predicted-ttft")
    fleet = ReplicaSet(on_removed=lambda replica: decider.forget(replica.replica_id),
                       on_renamed=decider.renamed)
    url = "http://10.0.0.7:8000"
    fleet.set_urls([url])
    (replica,) = fleet.replicas.values()
    address = replica.replica_id
    request = in_flight.open(replica, 100)  # routed before any heartbeat
    metrics.requests.labels(address, "predicted-ttft", "200").inc()
    decider.hot.sent(address, [1, 2], time.monotonic())
    decider.calibration.observe(address, 0.5, 1.0)
    heartbeats.feed = feed({"pod-a": Heartbeat("pod-a", "m", url, 16, 1, 0, 3, 12, time.time())})
    heartbeats.fold_into(fleet, {})
    assert replica.replica_id == "pod-a"
    assert in_flight.ledger("pod-a") is request.ledger  # the open request is still counted
    in_flight.close(request)
    fleet.set_urls([])
    text = generate_latest(metrics.registry).decode()
    for name in (address, "pod-a"):
        assert f'replica="{name}"' not in text
        assert in_flight.ledger(name) is None
        assert decider.calibration.pairs(name) == []
    assert decider.hot.footprint(address, time.monotonic()) == 0


def test_the_decider_stretches_predictions_and_the_hot_window_to_the_slowest_prefill_wait() -> None:
    """A request sent 40 s ago has no first byte yet: predictions live 80 s and a prefix sent
    twice within 160 s is hot (the floors, 10 s and 30 s, are for fast fleets)."""
    decider, _, in_flight, _ = parts("predicted-ttft")
    replicas = [Replica(f"http://r{i}", f"r{i}", healthy=True) for i in range(2)]
    request = in_flight.open(replicas[0], 528)
    request.ledger.open[request.key].sent_at -= 40.0
    decider.decide(replicas, [1, 2, 3], 1, None, 48, 16)
    assert decider.index.prediction_ttl_s == pytest.approx(80.0, abs=0.5)
    assert decider.hot.window_s == pytest.approx(160.0, abs=1.0)


def test_overload_verdicts_begin_and_end_the_hysteresis() -> None:
    since: dict[str, float] = {}
    seen: dict[str, float] = {}
    note_overload(since, seen, ("r0", True), 10.0)
    note_overload(since, seen, ("r0", True), 12.0)  # still overloaded: it began at 10
    note_overload(since, seen, None, 13.0)  # nobody judged (a cold prompt)
    assert since == {"r0": 10.0}
    note_overload(since, seen, ("r0", False), 14.0)
    assert since == {}


def test_an_overload_nobody_judged_for_the_hot_window_is_over() -> None:
    """r0 holds the prompt with 4,000 tokens queued (4.0 s at its rate) against an idle r1 (0.528 s
    plus 0.512 s saved): truly overloaded. Judged so from a minute ago until a moment ago, the
    overload has outlasted the hold and the request moves; judged so once, a minute ago, and by
    nobody since (longer than the 30 s hot window), it is no evidence of an overload now: the
    hysteresis begins anew and r0 keeps the request."""
    for last_verdict_ago, expected in ((1.0, "r1"), (60.0, "r0")):
        decider, heartbeats, _, _ = parts("predicted-ttft")
        wall = time.time()
        heartbeats.feed = feed({
            "r0": beat("r0", 1, wall, prefill_tokens_per_s=1000.0, prefill_tokens_waiting=4000),
            "r1": beat("r1", 0, wall, prefill_tokens_per_s=1000.0)})
        replicas = [Replica(f"http://r{i}", f"r{i}", healthy=True) for i in range(2)]
        hashes = list(range(1000, 1033))
        decider.index.stored("r0", hashes)
        now = time.monotonic()
        decider.overloaded_since["r0"] = now - 60.0
        decider.overload_seen["r0"] = now - last_verdict_ago
        assert decider.decide(replicas, hashes, hashes[0], None, 528, 16).ranked[0] == expected
        if expected == "r0":  # judged overloaded again now: the overload begins now
            assert decider.overloaded_since["r0"] >= now


def test_stale_overloads_are_forgotten_and_fresh_ones_kept() -> None:
    since, seen = {"r0": 0.0, "r1": 5.0}, {"r0": 10.0, "r1": 45.0}
    forget_stale_overloads(since, seen, 50.0, 30.0)
    assert since == {"r1": 5.0} and seen == {"r1": 45.0}
    note_overload(since, seen, ("r1", False), 51.0)
    assert since == {} and seen == {}


def test_a_ledger_knows_its_slowest_prefill_wait() -> None:
    from kvscale.router.prefill_ledger import PrefillLedger

    ledger = PrefillLedger()
    ledger.sent(1, 500, now=0.0)
    ledger.sent(2, 500, now=5.0)
    ledger.started(2, now=8.0)  # waited 3 s
    assert ledger.prefill_wait(now=20.0) == 20.0  # the first still waits
    ledger.started(1, now=21.0)
    assert ledger.prefill_wait(now=30.0) == 21.0  # the recent waits remember it


def test_group_homes_count_the_groups_each_replica_is_home_to() -> None:
    """A group's leading block counts at the replica it was last sent to: sent again elsewhere it
    moves, and a group forgotten (least recently sent first) counts nowhere."""
    homes = GroupHomes(capacity=3)
    for group, replica in (("a", "r0"), ("b", "r0"), ("c", "r1"), ("a", "r1")):
        homes.remember(group, replica)
    assert (homes.homed("r0"), homes.homed("r1"), homes.homed("r2")) == (1, 2, 0)
    homes.remember("d", "r2")  # "b" was sent least recently: forgotten
    assert (homes.get("b"), homes.homed("r0"), homes.homed("r1"), homes.homed("r2")) == (None, 0, 2, 1)
    homes.remember(None, "r0")
    assert homes.homed("r0") == 0


def test_group_homes_order_the_replicas_by_when_a_group_last_made_them_home() -> None:
    """``last_homed``: a group placed or moved there counts; sent again where it already is, no."""
    homes = GroupHomes()
    for group, replica in (("a", "r0"), ("b", "r1"), ("a", "r0"), ("c", "r2"), ("b", "r1")):
        homes.remember(group, replica)
    assert [homes.last_homed(r) for r in ("r0", "r1", "r2", "r3")] == [1, 2, 3, 0]
    homes.remember("a", "r1")  # moved
    assert homes.last_homed("r1") == 4
