"""Fair share between tenants waiting in the router (docs/router.md, "Fair share when the fleet is
saturated"): the pure decisions (router/fair_share.py, router/saturation.py) and the queue that
holds their state (router/fair_queue.py), driven on an event loop without a server."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import httpx
import pytest
from fair_queue_helpers import app_over_one_replica, free_slots_one_by_one
from starlette.requests import Request
from starlette.responses import Response

from kvscale.kv_index_schema import Heartbeat
from kvscale.router import fair_share
from kvscale.router.cli_router import add_arguments, config_from_args
from kvscale.router.config import RouterConfig
from kvscale.router.fair_queue import FairQueue, Turn, queued_turn
from kvscale.router.fleet_room import room_on
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.in_flight import InFlight
from kvscale.router.metrics import RouterMetrics
from kvscale.router.replicas import Replica as RouterReplica
from kvscale.router.saturation import KV_FULL, ReplicaLoad, free_slots, room
from kvscale.router.tenancy import Grant

MODEL = "fake"


def test_a_request_may_lower_its_urgency_never_raise_it_above_its_tenants() -> None:
    assert fair_share.band(0, None) == 0
    assert fair_share.band(0, 5) == 5  # less urgent: taken
    assert fair_share.band(5, 0) == 5  # more urgent than its tenant's: not taken
    assert fair_share.band(-3, -1) == -1
    for bad in (True, "1", 1.5, 2**31 + 1, -(2**31) - 1):
        assert fair_share.band(2, bad) == 2


def test_the_most_urgent_band_goes_first_then_the_smallest_counter_then_the_oldest() -> None:
    heads = {"a": (0, 5), "b": (0, 3), "c": (1, 1), "d": (0, 9)}
    counters = {"a": 10.0, "b": 10.0, "c": 0.0, "d": 2.0}
    assert fair_share.dispatch_order(heads, counters) == ["d", "b", "a", "c"]
    assert fair_share.dispatch_order({"x": (0, 2), "y": (0, 1)}, {}) == ["y", "x"]


def test_a_tenant_that_starts_waiting_is_lifted_to_the_others_and_banks_no_credit() -> None:
    assert fair_share.lifted(0.0, [500.0, 300.0], last_served=900.0) == 300.0
    assert fair_share.lifted(400.0, [500.0, 300.0], last_served=900.0) == 400.0
    assert fair_share.lifted(0.0, [], last_served=900.0) == 900.0
    assert fair_share.charged(100.0, 50, weight=2.0) == 125.0
    assert fair_share.pruned({"a": 1.0, "b": 5.0, "c": 9.0}, ["a"], floor=5.0) == {"a": 1.0, "c": 9.0}


def serve(weights: dict[str, float], costs: dict[str, list[int]], rounds: int,
          start: dict[str, float] | None = None) -> tuple[dict[str, int], list[int]]:
    """Always backlogged tenants served one request at a time by dispatch_order: the tokens each
    was served, and the gap between the first two (in tokens / weight) after every request."""
    counters = dict(start or {})
    served = {t: 0 for t in weights}
    turns = {t: 0 for t in weights}
    gaps: list[int] = []
    names = list(weights)
    for _ in range(rounds):
        heads = {t: (0, turns[t]) for t in weights}
        tenant = fair_share.dispatch_order(heads, counters)[0]
        cost = costs[tenant][turns[tenant] % len(costs[tenant])]
        counters[tenant] = fair_share.charged(counters.get(tenant, 0.0), cost, weights[tenant])
        served[tenant] += cost
        turns[tenant] += 1
        a, b = names[0], names[1]
        gaps.append(abs(served[a] / weights[a] - served[b] / weights[b]))
    return served, gaps


def test_two_backlogged_tenants_of_equal_weight_stay_within_one_request_of_each_other() -> None:
    rng = random.Random(7)
    big, small = [rng.randint(1, 4096) for _ in range(50)], [rng.randint(1, 64) for _ in range(50)]
    served, gaps = serve({"heavy": 1.0, "light": 1.0}, {"heavy": big, "light": small}, 3000)
    # VTC's bound: the service gap never passes the largest single request's tokens.
    assert max(gaps) <= max(big + small)
    assert abs(served["heavy"] - served["light"]) <= max(big)


def test_weights_share_the_tokens_in_their_ratio() -> None:
    served, _ = serve({"gold": 3.0, "bronze": 1.0}, {"gold": [100], "bronze": [100]}, 4000)
    assert served["gold"] / served["bronze"] == pytest.approx(3.0, rel=0.01)


def test_free_slots_come_from_the_replicas_own_load_and_unknown_load_never_holds() -> None:
    assert room(ReplicaLoad(8, 3)) == 5
    assert room(ReplicaLoad(8, 12)) == 0
    assert room(ReplicaLoad(8, 3, kv_usage=KV_FULL)) == 0  # blocks held: it would wait for them
    assert room(ReplicaLoad(8, 0, kv_usage=1.0)) == 8  # an idle replica's cached blocks free up
    assert free_slots([ReplicaLoad(8, 3), ReplicaLoad(4, 4)]) == 5
    assert free_slots([ReplicaLoad(8, 3), None]) is None
    assert free_slots([ReplicaLoad(0, 3)]) is None  # a heartbeat without max_num_seqs


def test_requests_this_router_has_open_on_a_replica_are_ahead_whatever_its_heartbeat_says() -> None:
    """A heartbeat taken after our sends but before they reached its engine (a front end slow to
    parse them on a loaded host) counts none of them: they are still ahead there, and the room
    check lets no more through (docs/router.md, "Fair share when the fleet is saturated")."""
    replica = RouterReplica("http://r0", "r0", healthy=True)
    in_flight = InFlight(RouterMetrics().in_flight)
    for _ in range(4):
        in_flight.open(replica, 8)
    beat = Heartbeat("r0", MODEL, "http://r0", 16, 0, 0, 0, 100, time.time() + 0.01, max_num_seqs=4)
    heartbeats = HeartbeatTable(SimpleNamespace(heartbeats={"r0": beat}, healthy=True))  # type: ignore[arg-type]
    assert room_on([replica], heartbeats, in_flight) == 0
    assert room(ReplicaLoad(4, 1, own_open=3)) == 1  # the heartbeat's count when it is the larger
    assert room(ReplicaLoad(4, 0, own_open=2)) == 2


def test_kvscale_router_takes_max_queue_wait_with_redis_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_REDIS_URL", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def config(*argv: str) -> RouterConfig:
        return config_from_args(parser.parse_args(["--replicas", "http://127.0.0.1:1", *argv]))

    assert config().max_queue_wait_s is None  # off by default: every request sent at once
    assert config("--max-queue-wait", "30", "--redis", "redis://127.0.0.1:1").max_queue_wait_s == 30
    with pytest.raises(SystemExit, match="needs --redis"):
        config("--max-queue-wait", "30")
    with pytest.raises(SystemExit, match="must be positive"):
        config("--max-queue-wait", "0", "--redis", "redis://127.0.0.1:1")


def status_of(result: Turn | Response) -> int:
    return result.status_code if isinstance(result, Response) else 200


def test_the_queue_lets_requests_through_while_there_is_room_and_counts_the_unsent() -> None:
    async def run() -> None:
        queue = FairQueue(max_wait_s=5)
        free = [2]
        first = await queue.enter("a", 0, 1.0, 10, lambda: free[0])
        second = await queue.enter("a", 0, 1.0, 10, lambda: free[0])
        assert isinstance(first, Turn) and isinstance(second, Turn)
        # Two let through, neither in a replica's count yet: a third waits.
        third = asyncio.ensure_future(queue.enter("a", 0, 1.0, 10, lambda: free[0]))
        await asyncio.sleep(0)
        assert queue.waiting == 1
        # Sent: the replicas' counts have them from now, and they fill the room.
        first.forwarding(None)
        second.forwarding(None)
        free[0] = 0
        queue.dispatch()
        assert queue.waiting == 1
        free[0] = 1  # the first one's answer ends: its slot goes to the one waiting
        first.done(200, b"")
        assert status_of(await third) == 200
        assert queue.last_served == 30.0  # three requests of 10 tokens, the reservation kept

    asyncio.run(run())


def test_a_light_tenant_overtakes_a_heavy_ones_backlog_and_a_band_overtakes_both() -> None:
    async def run() -> list[str]:
        queue = FairQueue(max_wait_s=5)
        free = [0]
        order: list[str] = []

        async def ask(tenant: str, band: int, cost: int) -> None:
            turn = await queue.enter(tenant, band, 1.0, cost, lambda: free[0])
            assert isinstance(turn, Turn)
            order.append(tenant)
            turn.forwarding(None)

        waiting = [asyncio.ensure_future(ask("heavy", 0, 1000)) for _ in range(5)]
        await asyncio.sleep(0)
        waiting += [asyncio.ensure_future(ask("light", 0, 10)) for _ in range(2)]
        waiting.append(asyncio.ensure_future(ask("urgent", -1, 10_000)))
        await asyncio.sleep(0)
        await free_slots_one_by_one(queue, free, order, len(waiting))
        await asyncio.gather(*waiting)
        return order

    order = asyncio.run(run())
    assert order[0] == "urgent"
    # heavy is charged 1000 a request, light 10: light's two go as soon as heavy leads.
    assert order[1:] == ["heavy", "light", "light", "heavy", "heavy", "heavy", "heavy"]


def test_a_request_waits_at_most_max_queue_wait_and_the_queue_is_bounded() -> None:
    async def run() -> tuple[Response, Response, FairQueue]:
        queue = FairQueue(max_wait_s=0.05, metrics=RouterMetrics(), max_waiting=1)
        waited = asyncio.ensure_future(queue.enter("a", 0, 1.0, 1, lambda: 0))
        await asyncio.sleep(0)
        full = await queue.enter("b", 0, 1.0, 1, lambda: 0)
        timed_out = await waited
        assert isinstance(full, Response) and isinstance(timed_out, Response)
        return full, timed_out, queue

    full, timed_out, queue = asyncio.run(run())
    for refused in (full, timed_out):
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert json.loads(bytes(refused.body))["error"]["code"] == "overloaded"
    assert queue.waiting == 0 and not queue.queues
    assert queue.metrics is not None
    sample = queue.metrics.registry.get_sample_value
    assert sample("kvscale_router_queue_waits_total", {"outcome": "full"}) == 1
    assert sample("kvscale_router_queue_waits_total", {"outcome": "timeout"}) == 1
    assert sample("kvscale_router_queue_wait_seconds_count") == 1  # the full one never waited
    assert sample("kvscale_router_queued_requests") == 0
    waited = sample("kvscale_router_tenant_queue_wait_seconds_total", {"tenant": "a"})
    assert waited is not None and waited >= 0.05


def test_a_client_that_leaves_while_waiting_is_499_and_leaves_the_queue() -> None:
    async def run() -> tuple[Turn | Response, FairQueue]:
        queue = FairQueue(max_wait_s=5)
        left = asyncio.Event()
        waited = asyncio.ensure_future(queue.enter("a", 0, 1.0, 1, lambda: 0, left.wait))
        await asyncio.sleep(0)
        left.set()
        return await waited, queue

    result, queue = asyncio.run(run())
    assert status_of(result) == 499 and queue.waiting == 0


def test_a_refused_wait_carries_the_rate_limit_headers_and_gives_the_reservation_back() -> None:
    settled: list[tuple[int, bytes]] = []
    grant = Grant("team-a", {"x-ratelimit-remaining-tokens": "90"},
                  lambda status, tail: settled.append((status, tail)))

    async def run() -> Turn | Response:
        async def receive() -> dict:
            await asyncio.sleep(3600)  # the client stays
            return {"type": "http.disconnect"}

        request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                           "headers": []}, receive)
        return await queued_turn(FairQueue(max_wait_s=0.02), request, "completions",
                                 {"prompt": "hi"}, 2, 20, lambda: 0, grant)

    refused = asyncio.run(run())
    assert isinstance(refused, Response) and refused.status_code == 503
    assert refused.headers["x-ratelimit-remaining-tokens"] == "90"
    assert settled == [(503, b"")]  # rate_limits.settlement: an error status gives it all back


def test_the_counter_is_corrected_by_the_usage_the_answer_reports() -> None:
    async def run() -> FairQueue:
        queue = FairQueue(max_wait_s=5)
        turn = await queue.enter("a", 0, 2.0, 100, lambda: None)
        assert isinstance(turn, Turn)
        turn.forwarding(None)
        tail = b'"usage": {"prompt_tokens": 30, "completion_tokens": 10, "total_tokens": 40}}'
        turn.done(200, tail)
        turn.done(200, tail)  # told once only
        return queue

    queue = asyncio.run(run())
    # 40 tokens served at weight 2: what a tenant arriving next is lifted to.
    assert queue.last_served == 20.0 and not queue.unsent


class Replica(BaseHTTPRequestHandler):
    """A replica on loopback: /v1/models names MODEL, every generation is answered at once."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": [{"id": MODEL}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self._answer({"id": "c", "object": "text_completion", "model": MODEL,
                      "choices": [{"index": 0, "text": "x"}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _answer(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_router_holds_a_request_while_its_replica_is_full_and_sends_it_when_room_frees() -> None:
    """The wiring: the router's app with --max-queue-wait, its replica's heartbeat (as the Redis
    feed would hold it) saying the batch is full, then that a slot is free."""
    async def run() -> tuple[int, int, float, int, dict[str, float | None]]:
        async with app_over_one_replica(Replica, MODEL, 1, policy="round-robin",
                                        max_queue_wait_s=0.6) as (app, set_running):
            router = app.state.router
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            async with client:
                refused = await client.post("/v1/completions", json=body)  # full all along
                waiting = asyncio.ensure_future(client.post("/v1/completions", json=body))
                await asyncio.sleep(0.2)
                assert not waiting.done() and router.queue.waiting == 1
                # What the operator's autoscaler reads (counted with the servers' waiting).
                assert (await client.get("/health")).json()["queued"] == 1
                set_running(0)  # a slot freed: the next tick sends it
                started = time.monotonic()
                answered = await waiting
            waits = {outcome: router.metrics.registry.get_sample_value(
                "kvscale_router_queue_waits_total", {"outcome": outcome})
                for outcome in ("timeout", "released")}
            return (refused.status_code, answered.status_code, time.monotonic() - started,
                    int(refused.headers["retry-after"]), waits)

    refused, answered, released_after_s, retry_after, waits = asyncio.run(run())
    assert (refused, retry_after) == (503, 1)
    assert waits == {"timeout": 1, "released": 1}
    assert answered == 200 and released_after_s < 0.5


class SlowReplica(Replica):
    """A replica whose generations are answered after ``hold_s``; counts those it holds at once."""

    hold_s = 0.5
    open_now = 0
    most_open = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        cls = type(self)
        with cls.lock:
            cls.open_now += 1
            cls.most_open = max(cls.most_open, cls.open_now)
        time.sleep(cls.hold_s)
        with cls.lock:
            cls.open_now -= 1
        super().do_POST()


def test_a_burst_arriving_together_fills_the_free_slots_and_the_rest_waits_in_the_router() -> None:
    """Requests let through in one loop turn are counted until the replica's ledger has them: the
    forwarding starts in a task of its own, a turn later, and a burst arriving meanwhile must not
    see the slot the first one took as still free (with a batch of one, all five went at once)."""
    async def run() -> tuple[int, list[int]]:
        async with app_over_one_replica(SlowReplica, MODEL, 0, policy="round-robin",
                                        max_queue_wait_s=10) as (app, _):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            async with client:
                answers = await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(5)])
            return SlowReplica.most_open, [a.status_code for a in answers]

    most_open, statuses = asyncio.run(run())
    assert statuses == [200] * 5
    assert most_open == 1, f"{most_open} requests reached a replica with one batch slot at once"
