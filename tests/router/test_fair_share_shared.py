"""The fair queue's tenant counters shared by routers through Redis (docs/router.md, "Fair share
across routers"): the schema's arguments and script (kvscale/fair_share_schema.py), what the
queue sends (router/fair_queue.py), two queues on one real redis-server ordering alike
(router/shared_counters.py), and the fall-back to local counters when Redis is down."""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import pytest
import redis
from fair_queue_helpers import free_slots_one_by_one

from kvscale.fair_share_schema import (
    COUNTER_TTL_S,
    LAST_SERVED,
    LAST_SERVED_KEY,
    MAX_FLOOR_TENANTS,
    NO_FLOOR,
    WAITING_LUA,
    WAITING_TTL_S,
    counter_key,
    counters_from,
    update_args,
    update_script,
    waiting_args,
    waiting_key,
)
from kvscale.processes import free_port
from kvscale.router.fair_queue import FairQueue, Turn
from kvscale.router.metrics import RouterMetrics
from kvscale.router.shared_counters import SharedCounters


def test_the_scripts_arguments_refuse_what_is_not_a_finite_number_or_a_known_floor() -> None:
    assert update_args("a", LAST_SERVED, 2.5, True, "r1")[2:] == ["last", "2.5", "1", COUNTER_TTL_S, "r1"]
    assert update_args("a", ["b", "c"], 0.0, False, "r1")[2:] == ["min", "0.0", "0", COUNTER_TTL_S,
                                                                 "r1", "b", "c"]
    assert waiting_args("r1", ["a", "b"], True)[1:] == ["r1", repr(WAITING_TTL_S), "1", "a", "b"]
    with pytest.raises(ValueError, match="1 to"):
        waiting_args("r1", [], False)
    for added in (math.inf, math.nan, -math.inf):
        with pytest.raises(ValueError, match="finite"):
            update_args("a", NO_FLOOR, added, False)
    with pytest.raises(ValueError, match="floor"):
        update_args("a", "lowest", 1.0, False)
    for names in ([], ["t"] * (MAX_FLOOR_TENANTS + 1)):
        with pytest.raises(ValueError, match="smallest of 1 to"):
            update_args("a", names, 1.0, False)
    assert counters_from([b"1.5", None, b"x", b"inf", "2"]) == [1.5, None, None, None, 2.0]


class Recorder:
    """Stands in for SharedCounters: what the queue sends, answered by nobody."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str | float, float, bool]] = []
        self.marks: list[tuple[list[str], bool]] = []

    def waiting(self, tenants: list[str], waiting: bool) -> None:
        self.marks.append((tenants, waiting))

    def update(self, tenant: str, floor: str | float, added: float, served: bool,
               apply: object) -> None:
        self.sent.append((tenant, floor, added, served))

    def refresh(self, tenants: list[str], apply: object) -> None:
        pass


def test_the_queue_sends_each_lift_and_charge_as_it_makes_them() -> None:
    shared = Recorder()

    async def run() -> list[tuple[str, str | float, float, bool]]:
        queue = FairQueue(max_wait_s=5, shared=shared)  # type: ignore[arg-type]
        free = [1]
        first = await queue.enter("a", 0, 2.0, 100, lambda: free[0])  # none waits: let through
        assert isinstance(first, Turn)
        first.forwarding(None)
        free[0] = 0
        waiting = asyncio.ensure_future(queue.enter("b", 0, 1.0, 10, lambda: free[0]))
        await asyncio.sleep(0)
        behind = asyncio.ensure_future(queue.enter("c", 0, 1.0, 10, lambda: free[0]))
        await asyncio.sleep(0)
        free[0] = 1
        first.done(200, b'"usage": {"prompt_tokens": 30, "completion_tokens": 10}')
        for pending in (waiting, behind):
            turn = await pending
            assert isinstance(turn, Turn)
            turn.forwarding(None)
            free[0] = 1
            turn.done(200, b"")
        return shared.sent

    sent = asyncio.run(run())
    assert sent[:4] == [
        ("a", LAST_SERVED, 50.0, True),  # lifted to the fleet's last served, charged at weight 2
        ("b", LAST_SERVED, 0.0, False),  # starts waiting, none waits before it: lifted alike
        ("c", ["b"], 0.0, False),  # lifted to the smallest counter of those waiting (b's)
        ("a", NO_FLOOR, -30.0, False),  # a's usage (40 tokens) corrects its reservation (100)
    ]
    assert ("b", NO_FLOOR, 10.0, True) in sent[4:] and ("c", NO_FLOOR, 10.0, True) in sent[4:]
    # Where they wait, for the other routers: b and c from their first waiting request to their
    # last one's release (a, let through at once, never waited here).
    assert shared.marks == [(["b"], True), (["c"], True), (["b"], False), (["c"], False)]


def test_a_tenant_waiting_at_another_router_is_not_lifted(client: redis.Redis) -> None:
    """Router r2's queue for b emptied while b still waits at r1: b is backlogged in the fleet
    and keeps the credit it is owed; once r1 says b waits no more (or its word lapses, a router
    that died), b is lifted as a tenant that starts waiting is."""
    update, say = update_script(client), client.register_script(WAITING_LUA)
    a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    update(keys=[], args=update_args(a, NO_FLOOR, 100.0, True, "r1"))
    update(keys=[], args=update_args(b, NO_FLOOR, 60.0, False, "r1"))
    assert say(keys=[], args=waiting_args("r1", [a, b], True)) == 2
    # r2: b starts waiting there, a waits there: the floor would be a's 100.
    assert counters_from(update(keys=[], args=update_args(b, [a], 0.0, False, "r2")))[0] == 60.0
    assert counters_from(update(keys=[], args=update_args(b, LAST_SERVED, 0.0, False, "r2")))[0] == 60.0
    # r1's own word does not hold r1's lift: its own queue for b is what it knows.
    assert counters_from(update(keys=[], args=update_args(b, [a], 0.0, False, "r1")))[0] == 100.0
    update(keys=[], args=update_args(a, NO_FLOOR, 50.0, True, "r1"))
    say(keys=[], args=waiting_args("r1", [b], False))
    assert client.zrange(waiting_key(b), 0, -1) == []
    assert counters_from(update(keys=[], args=update_args(b, [a], 0.0, False, "r2")))[0] == 150.0
    # A word that lapsed holds nothing.
    c = f"c-{uuid.uuid4().hex[:6]}"
    say(keys=[], args=waiting_args("r1", [c], True, ttl_s=0.2))
    assert counters_from(update(keys=[], args=update_args(c, [a], 0.0, False, "r2")))[0] == 0.0
    time.sleep(0.3)
    assert counters_from(update(keys=[], args=update_args(c, [a], 0.0, False, "r2")))[0] == 150.0
    assert 0 < client.ttl(waiting_key(a)) <= 2 * WAITING_TTL_S


@pytest.fixture
def client(session_redis) -> redis.Redis:
    # A database of its own: the session's replicas and routers use 0.
    return redis.Redis.from_url(f"redis://127.0.0.1:{session_redis.port}/4")


def test_the_script_lifts_then_charges_and_moves_the_last_served(client: redis.Redis) -> None:
    update = update_script(client)
    a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    client.delete(LAST_SERVED_KEY)
    assert counters_from(update(keys=[], args=update_args(a, LAST_SERVED, 40.0, True))) == [40.0, 40.0]
    assert counters_from(update(keys=[], args=update_args(b, LAST_SERVED, 0.0, False))) == [40.0, 40.0]
    assert counters_from(update(keys=[], args=update_args(b, NO_FLOOR, 0.25, False))) == [40.25, 40.0]
    assert counters_from(update(keys=[], args=update_args(a, NO_FLOOR, 60.0, False))) == [100.0, 40.0]
    c = f"c-{uuid.uuid4().hex[:6]}"  # lifted to the smallest of a's and b's: b's
    assert counters_from(update(keys=[], args=update_args(c, [a, b], 0.0, False))) == [40.25, 40.0]
    assert counters_from(update(keys=[], args=update_args(b, NO_FLOOR, 1.0, True))) == [41.25, 41.25]
    assert 0 < client.ttl(counter_key(a)) <= COUNTER_TTL_S
    assert 0 < client.ttl(LAST_SERVED_KEY) <= COUNTER_TTL_S


def test_two_routers_queues_on_one_redis_release_tenants_in_the_same_order(client) -> None:
    """At the second router ``heavy`` and then ``light`` wait for a slot, lifted to the same
    counter; meanwhile the first router serves ``heavy`` 3000 tokens. When the slot frees it goes
    to ``light``, as it would at the first router. With counters of its own the second router
    would know nothing of that service and send ``heavy`` first (the same counter, the older
    request)."""
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/4"
    heavy, light = f"heavy-{uuid.uuid4().hex[:6]}", f"light-{uuid.uuid4().hex[:6]}"

    async def run() -> list[str]:
        metrics = RouterMetrics()
        ones = [SharedCounters(url, 2.0, lambda up: metrics.fair_share_shared.set(int(up)))
                for _ in range(2)]
        first, second = (FairQueue(5, metrics, shared=shared) for shared in ones)
        try:
            free = [0]
            order: list[str] = []

            async def ask(tenant: str) -> None:
                turn = await second.enter(tenant, 0, 1.0, 10, lambda: free[0])
                assert isinstance(turn, Turn)
                order.append(tenant)
                turn.forwarding(None)

            waiting = [asyncio.ensure_future(ask(heavy))]
            await asyncio.sleep(0)
            waiting.append(asyncio.ensure_future(ask(light)))
            deadline = time.monotonic() + 10
            while len(second.queues) < 2 or ones[1]._tasks:
                assert time.monotonic() < deadline, "the lifts were not answered"
                await asyncio.sleep(0.01)
            assert second.counters[heavy] == second.counters[light]
            for _ in range(3):
                turn = await first.enter(heavy, 0, 1.0, 1000, lambda: None)
                assert isinstance(turn, Turn)
                turn.forwarding(None)
                turn.done(200, b"")
            while second.counters[heavy] <= second.counters[light]:  # the next tick reads it
                assert time.monotonic() < deadline, "the second router never read heavy's"
                await asyncio.sleep(0.01)
            await free_slots_one_by_one(second, free, order, 2)
            await asyncio.gather(*waiting)
            return order
        finally:
            for shared in ones:
                await shared.close()

    assert asyncio.run(run()) == [light, heavy]
    assert float(client.get(counter_key(heavy))) >= 3000 + float(client.get(counter_key(light)))


def test_the_queue_orders_by_its_own_counters_while_redis_is_down() -> None:
    async def run() -> tuple[list[str], SharedCounters, RouterMetrics]:
        metrics = RouterMetrics()
        shared = SharedCounters(f"redis://127.0.0.1:{free_port()}/0", 0.05,
                                lambda up: metrics.fair_share_shared.set(int(up)))
        queue = FairQueue(5, metrics, shared=shared)
        assert metrics.registry.get_sample_value("kvscale_router_fair_share_shared") == 1
        try:
            free = [0]
            order: list[str] = []

            async def ask(tenant: str, cost: int) -> None:
                turn = await queue.enter(tenant, 0, 1.0, cost, lambda: free[0])
                assert isinstance(turn, Turn)
                order.append(tenant)
                turn.forwarding(None)

            waiting = []
            for tenant, cost in (("heavy", 1000), ("heavy", 1000), ("light", 10)):
                waiting.append(asyncio.ensure_future(ask(tenant, cost)))
                await asyncio.sleep(0)
            while shared._tasks:
                await asyncio.sleep(0.01)
            await free_slots_one_by_one(queue, free, order, 3)
            await asyncio.gather(*waiting)
            return order, shared, metrics
        finally:
            await shared.close()

    order, shared, metrics = asyncio.run(run())
    # heavy's first 1000 tokens are in this router's own counter: light goes next.
    assert order == ["heavy", "light", "heavy"] and shared.down and not shared.pending
    assert metrics.registry.get_sample_value("kvscale_router_fair_share_shared") == 0


def test_one_routers_updates_reach_redis_in_the_order_it_made_them() -> None:
    """A lift sent first and answered slowly (a new connection, the script loaded on first use)
    still runs before the next one: the second tenant's lift to the smallest waiting counter must
    see the first tenant's counter in Redis."""
    ran: list[str] = []

    class Calls:
        async def run_script(self, script: str, keys: list[str], args: list[str]) -> list[bytes]:
            tenant = args[1]
            await asyncio.sleep(0.05 if not ran and tenant == "first" else 0)
            ran.append(tenant)
            return [b"1", b"1"]

    async def run() -> None:
        shared = SharedCounters("redis://127.0.0.1:1/0", 1.0)
        shared._calls = lambda: Calls()  # type: ignore[method-assign,assignment,return-value]
        shared.update("first", LAST_SERVED, 0.0, False, lambda counter, last: None)
        shared.update("second", ["first"], 0.0, False, lambda counter, last: None)
        while shared._tasks:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert ran == ["first", "second"]
