"""`--max-queue-wait`: generation requests wait in the router while the replicas that could take
them have no room, and leave by priority band, then weighted fair share between tenants
(docs/router.md, "Fair share when the fleet is saturated").

The decisions are pure (fair_share.py: the order and the counters; saturation.py: the room);
this is their state and the waiting itself. Every request let through, whether it waited or
not, is charged to its tenant's counter: its reservation (prompt plus the completion asked for,
as the rate limits count it) when it leaves, corrected by the usage its answer reports. With
tenants, the counters are the fleet's, kept in Redis (router/shared_counters.py). Only the
router's event loop touches this, so it has no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvscale.fair_share_schema import LAST_SERVED, NO_FLOOR, Floor
from kvscale.router import fair_share
from kvscale.router import rate_limits as rules
from kvscale.router.band_preemption import NO_SEQUENCES, may_preempt
from kvscale.router.client_watch import CLIENT_GONE, disconnect_of
from kvscale.router.errors import openai_error
from kvscale.router.metrics import RouterMetrics
from kvscale.router.relay import RelayResponse
from kvscale.router.shared_counters import SharedCounters
from kvscale.router.tenancy import Grant
from kvscale.router.tenants import SCOPE_KEY, Tenant

# Requests waiting at once, over all tenants; one more is answered 503 at once. The admission
# gate's --max-open-requests bounds them too; this holds where the app is served without it.
MAX_WAITING = 4096
RETRY_AFTER_S = 1
# A request let through is forwarded within a loop turn or two; one that never was stops
# holding a slot after this.
UNSENT_TTL_S = 5.0
# Heartbeats come about every 0.25 s.
TICK_S = 0.25


@dataclass
class _Waiter:
    tenant: str
    band: int
    arrival: int
    weight: float
    cost: int
    room: Callable[[], int | None]
    running: Callable[[], Mapping[int, int]] | None
    released: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class Turn:
    """A request let through: charged when it left the queue, settled when its answer ends.
    Without a queue (``queue`` None) it changes nothing."""

    def __init__(self, queue: FairQueue | None, key: int = 0, tenant: str = "",
                 weight: float = 1.0, cost: int = 0) -> None:
        self._queue = queue
        self._key = key
        self.tenant = tenant
        self.weight = weight
        self.cost = cost
        self._done = False

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """The handling of the request let through ended by an exception (one between its turn
        and its forwarding, or its cancellation): the turn ends too. Else its request would stay
        open in its band until restart, and band_preemption would let more urgent ones past a
        full fleet to displace it. The status is the answer the client gets, for the settlement."""
        if kind is not None:
            self.done(CLIENT_GONE if issubclass(kind, asyncio.CancelledError) else 500, b"")

    def sent(self) -> None:
        """It is being forwarded: the replicas' counts take it from here."""
        if self._queue is not None:
            self._queue.unsent.pop(self._key, None)

    def done(self, status: int, tail: bytes) -> None:
        """Its answer ended (or none came): the counter corrected by the usage reported, and the
        freed slot offered to whoever waits."""
        self.sent()
        if self._queue is None or self._done:
            return
        self._done = True
        self._queue.closed(self._key)
        delta = rules.settlement(self.cost, rules.usage_tokens(tail), status)
        self._queue.charge(self.tenant, delta, self.weight)
        self._queue.dispatch()

    def forwarding(self, on_done: Callable[[int, bytes], None] | None
                   ) -> Callable[[int, bytes], None] | None:
        """``settling``'s, for a request a replica's count has from now."""
        self.sent()
        return self.settling(on_done)

    def settling(self, on_done: Callable[[int, bytes], None] | None
                 ) -> Callable[[int, bytes], None] | None:
        """What the forwarding tells when a replica's answer ends (``on_done`` first). The turn
        stays unsent until ``sent``: the forwarding may start a loop turn later, and a request
        arriving meanwhile must not see its slot as free."""
        if self._queue is None:
            return on_done

        def both(status: int, tail: bytes) -> None:
            if on_done is not None:
                on_done(status, tail)
            self.done(status, tail)

        return both

    def ended(self, response: Response) -> Response:
        """The forwarding's response; one that is no replica's answer (a 502, a 499) ends here,
        a relayed one when its last byte is sent (``forwarding``)."""
        if not isinstance(response, RelayResponse):
            self.done(response.status_code, b"")
        return response


async def queued_turn(queue: FairQueue | None, request: Request, endpoint: str,
                      body: dict[str, Any], prompt_tokens: int, body_bytes: int,
                      room: Callable[[], int | None], grant: Grant,
                      running: Callable[[], Mapping[int, int]] | None = None) -> Turn | Response:
    """An HTTP request's turn (``tenant_turn``): its tenant the one its key named, a 499 when
    its client leaves while it waits."""
    tenant = request.scope.get(SCOPE_KEY)
    return await tenant_turn(queue, tenant if isinstance(tenant, Tenant) else None, endpoint, body,
                             prompt_tokens, body_bytes, room, grant, disconnect_of(request.receive), running)


async def tenant_turn(queue: FairQueue | None, tenant: Tenant | None, endpoint: str,
                      body: dict[str, Any], prompt_tokens: int, body_bytes: int,
                      room: Callable[[], int | None], grant: Grant,
                      client_left: Callable[[], Awaitable[None]] | None = None,
                      running: Callable[[], Mapping[int, int]] | None = None) -> Turn | Response:
    """A generation request's turn through ``queue`` (None: at once), on the HTTP port and the
    endpoint picker alike: charged its tokens as the rate limits reserve them, to its tenant
    (without tenants every request is one tenant's), in the band of its tenant's priority and
    its own ``priority`` field (fair_share.band). A refusal carries the tenant's rate-limit
    headers and settles its reservation as any answer that is no replica's does
    (rate_limits.settlement: a 503 gives it back)."""
    if queue is None:
        return Turn(None)
    name, weight, default = (tenant.name, tenant.weight, tenant.priority) if tenant is not None else ("", 1.0, 0)
    cost = rules.request_tokens(endpoint, body, prompt_tokens, body_bytes)
    turn = await queue.enter(name, fair_share.band(default, body.get("priority")), weight, cost,
                             room, client_left, running)
    if isinstance(turn, Response):
        turn.headers.update(grant.headers)
        if grant.on_done is not None:
            grant.on_done(turn.status_code, b"")
    return turn


class FairQueue:
    def __init__(self, max_wait_s: float, metrics: RouterMetrics | None = None,
                 max_waiting: int = MAX_WAITING, shared: SharedCounters | None = None,
                 replicas_preempt: bool = False) -> None:
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self.shared = shared
        self.max_waiting = max_waiting
        self.counters: dict[str, float] = {}
        self.last_served = 0.0  # the counter of the last tenant let through
        self._last_tenant: str | None = None
        self.queues: dict[str, deque[_Waiter]] = {}
        self.waiting = 0
        # Let through and not forwarded yet (no replica's count has them): key -> when let
        # through. One never forwarded (its handler failed) stops counting after UNSENT_TTL_S.
        self.unsent: dict[int, float] = {}
        self._keys = 0
        # While requests wait, dispatch runs every TICK_S too: the heartbeats may show room that
        # another router's requests, or the replicas' own steps, left.
        self._tick: asyncio.TimerHandle | None = None
        # The replicas run --scheduling-policy priority: a more urgent request is let through
        # without room while less urgent ones are open (band_preemption.py). Open requests, by
        # key: (band, let through without room), and their counts.
        self.replicas_preempt = replicas_preempt
        self.opened: dict[int, tuple[int, bool]] = {}
        self.open_by_band: Counter[int] = Counter()
        self.open_without_room = 0

    def charge(self, tenant: str, tokens: int, weight: float, floor: Floor = NO_FLOOR,
               served: bool = False) -> None:
        """Charge ``tokens`` to the tenant's counter, and to the shared one after lifting it to
        ``floor`` (its local lift was made at its arrival); ``served``: it is let through now."""
        self.counters[tenant] = fair_share.charged(self.counters.get(tenant, 0.0), tokens, weight)
        if tenant == self._last_tenant:  # a correction of the last served moves the floor too
            self.last_served = self.counters[tenant]
        if self.shared is not None:
            self.shared.update(tenant, floor, tokens / weight, served, self._mirror(tenant))

    def _mirror(self, tenant: str) -> Callable[[float, float], None]:
        """Redis's answer for a tenant's counter, which holds every router's charges."""
        def mirrored(counter: float, last_served: float) -> None:
            self.counters[tenant] = counter
            self.last_served = last_served

        return mirrored

    def _refreshed(self, counters: dict[str, float], last_served: float | None) -> None:
        self.counters.update({t: c for t, c in counters.items() if t in self.queues})
        if last_served is not None:
            self.last_served = last_served

    def _let_through(self, tenant: str, weight: float, cost: int,
                     floor: Floor = NO_FLOOR, band: int = 0, without_room: bool = False) -> int:
        """Charge it and count it unsent (and open, by band); its key."""
        self._last_tenant = tenant
        self.charge(tenant, cost, weight, floor, served=True)
        self._keys += 1
        self.unsent[self._keys] = time.monotonic()
        if self.replicas_preempt:
            self.opened[self._keys] = (band, without_room)
            self.open_by_band[band] += 1
            self.open_without_room += without_room
        return self._keys

    def closed(self, key: int) -> None:
        """The request let through as ``key`` ended."""
        band, without_room = self.opened.pop(key, (None, False))
        if band is not None:
            self.open_by_band[band] -= 1
            self.open_without_room -= without_room

    def _preempts(self, band: int, running: Callable[[], Mapping[int, int]] | None) -> bool:
        return self.replicas_preempt and may_preempt(band, self.open_by_band, self.open_without_room,
                                                     running() if running is not None else NO_SEQUENCES)

    def _has_room(self, room: Callable[[], int | None]) -> bool:
        cutoff = time.monotonic() - UNSENT_TTL_S
        for key in [k for k, at in self.unsent.items() if at < cutoff]:
            del self.unsent[key]
        free = room()
        return free is None or free - len(self.unsent) > 0

    async def enter(self, tenant: str, band: int, weight: float, cost: int,
                    room: Callable[[], int | None],
                    client_left: Callable[[], Awaitable[None]] | None = None,
                    running: Callable[[], Mapping[int, int]] | None = None) -> Turn | Response:
        """The request's turn, at once when nobody waits and there is room, else when
        ``dispatch`` releases it; or the 503 (it waited --max-queue-wait, or the queue is full),
        or the 499 (its client left while it waited). ``room``: the free slots on the replicas
        that could take it (saturation.free_slots); ``running``: the sequences they run by
        priority (``running_on``: those it may displace); ``cost``: its tokens as reserved."""
        floor: Floor = NO_FLOOR
        if tenant not in self.queues:
            waiting = [self.counters.get(t, 0.0) for t in self.queues]
            self.counters[tenant] = fair_share.lifted(self.counters.get(tenant, 0.0), waiting,
                                                      self.last_served)
            # The shared counter is lifted alike, by the fleet's counters of the same tenants.
            floor = list(self.queues) if waiting else LAST_SERVED
        if not self.queues and self._has_room(room):
            return Turn(self, self._let_through(tenant, weight, cost, floor, band), tenant, weight, cost)
        if not self.queues and self._preempts(band, running):
            return Turn(self, self._let_through(tenant, weight, cost, floor, band, True), tenant, weight, cost)
        if self.waiting >= self.max_waiting:
            self._waited("full", 0.0, tenant)
            return self._refusal(f"{self.waiting} requests wait in the router's queue, its limit")
        if floor != NO_FLOOR and self.shared is not None:
            self.shared.update(tenant, floor, 0.0, False, self._mirror(tenant))
        self._keys += 1
        waiter = _Waiter(tenant, band, self._keys, weight, cost, room, running)
        fresh = tenant not in self.queues
        self.queues.setdefault(tenant, deque()).append(waiter)
        self._count(+1)
        if fresh and self.shared is not None:  # the other routers lift it no more
            self.shared.waiting([tenant], True)
        since = time.monotonic()
        self.dispatch()  # its own model's replicas may have room though others' have none
        watch = asyncio.ensure_future(client_left()) if client_left is not None else None
        try:
            waits: set[asyncio.Future[Any]] = {waiter.released}
            if watch is not None:
                waits.add(watch)
            await asyncio.wait(waits, timeout=self.max_wait_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Its handler was cancelled (an ext_proc stream Envoy reset as its client left): a
            # turn given meanwhile ends unused, a wait counts as its client's leaving.
            if waiter.released.done():
                Turn(self, waiter.released.result(), tenant, weight, cost).done(CLIENT_GONE, b"")
            else:
                self._waited("disconnected", time.monotonic() - since, tenant)
            raise
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            if not waiter.released.done():
                self._remove(waiter)
        waited_s = time.monotonic() - since
        if waiter.released.done():
            self._waited("released", waited_s, tenant)
            return Turn(self, waiter.released.result(), tenant, weight, cost)
        if watch is not None and watch.done() and not watch.cancelled():
            self._waited("disconnected", waited_s, tenant)
            return Response(status_code=CLIENT_GONE)
        self._waited("timeout", waited_s, tenant)
        return self._refusal(f"the replicas had no room for {self.max_wait_s:g} s "
                             "(--max-queue-wait)")

    def _remove(self, waiter: _Waiter) -> None:
        queue = self.queues[waiter.tenant]
        queue.remove(waiter)
        self._count(-1)
        if not queue:
            del self.queues[waiter.tenant]
            if self.shared is not None:
                self.shared.waiting([waiter.tenant], False)

    def dispatch(self) -> None:
        """Release waiting requests while their replicas have room: the most urgent band first,
        then the smallest counter (fair_share.dispatch_order); a tenant whose oldest request's
        replicas are full is passed over for the next. Each is charged as it is released, so
        the next choice of the same pass sees it."""
        while self.queues:
            heads = {t: (q[0].band, q[0].arrival) for t, q in self.queues.items()}
            for tenant in fair_share.dispatch_order(heads, self.counters):
                waiter = self.queues[tenant][0]
                room = self._has_room(waiter.room)
                if room or self._preempts(waiter.band, waiter.running):
                    self._remove(waiter)
                    waiter.released.set_result(self._let_through(tenant, waiter.weight, waiter.cost,
                                                                 band=waiter.band, without_room=not room))
                    break
            else:
                break
        floor = min([self.counters.get(t, 0.0) for t in self.queues] + [self.last_served])
        self.counters = fair_share.pruned(self.counters, self.queues, floor)
        if self.queues and self._tick is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # told by a response finalized off the loop: the next arrival
                return  # or answer dispatches again
            self._tick = loop.call_later(TICK_S, self._ticked)

    def _count(self, change: int) -> None:
        self.waiting += change
        if self.metrics is not None:
            self.metrics.queued.set(self.waiting)

    def _waited(self, outcome: str, seconds: float, tenant: str) -> None:
        if self.metrics is not None:
            self.metrics.queue_waits.labels(outcome).inc()
            if outcome != "full":
                self.metrics.queue_wait_seconds.observe(seconds)
            if tenant:  # a tenant of the file (router/tenancy.py keeps its series)
                self.metrics.tenant_queue_wait.labels(tenant).inc(seconds)

    def _ticked(self) -> None:
        self._tick = None
        self.dispatch()
        if self.shared is not None and self.queues:  # for the next pass: other routers' charges
            self.shared.waiting(list(self.queues), True)  # renewed before it lapses
            self.shared.refresh(list(self.queues), self._refreshed)

    @staticmethod
    def _refusal(why: str) -> Response:
        refused = openai_error(503, f"{why}; retry shortly", "service_unavailable", "overloaded")
        refused.headers["retry-after"] = str(RETRY_AFTER_S)
        return refused
