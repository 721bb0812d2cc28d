"""Forwarding one decided request: failover down the ranking, then a streamed passthrough.

Connection errors, timeouts, a draining replica's 503 and other 5xx before the first body byte
move on to the next replica in the ranking (the last one's answer is the client's), except a
replica's 504: its --request-timeout was spent on the request, and another replica would spend
it again (docs/server.md "Request limits"); once a byte
went to the client the response is committed and streamed through chunk by chunk, never retried:
a replica that breaks off then reaches the client as an error event or an aborted connection
(relay.py). Until the first byte the client is watched: one that leaves cancels the request on
its replica (client_watch.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import httpx
from starlette.responses import Response

from kvscale.drain import DRAINING_HEADER
from kvscale.router.client_watch import CLIENT_GONE, unless_client_leaves
from kvscale.router.decision import SessionMemory
from kvscale.router.errors import openai_error
from kvscale.router.in_flight import InFlight, OpenRequest
from kvscale.router.index import PrefixIndex
from kvscale.router.metrics import RouterMetrics
from kvscale.router.rate_limits import USAGE_TAIL_BYTES
from kvscale.router.relay import RelayResponse, UpstreamBroke, at_event_boundary, error_event
from kvscale.router.replicas import Replica, ReplicaSet
from kvscale.router.ttft_calibration import TtftCalibration
from kvscale.tenant_limits_schema import TENANT_HEADER

log = logging.getLogger("kvscale.router")

# Response headers that describe one hop, not the body.
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
# endpoint -> (method, path on the replica). Generation goes through the routing decision; the
# others are a replica's own answers that a client should get at the router's URL too.
ENDPOINTS = {
    "chat": ("POST", "/v1/chat/completions"),
    "completions": ("POST", "/v1/completions"),
    "responses": ("POST", "/v1/responses"),
    "responses_get": ("GET", "/v1/responses/{id}"),  # Routed.path names the id
    "responses_delete": ("DELETE", "/v1/responses/{id}"),
    "tokenize": ("POST", "/tokenize"),
    "detokenize": ("POST", "/detokenize"),
    "version": ("GET", "/version"),
}


def book(index: PrefixIndex, in_flight: InFlight, replica: Replica, hashes: list[int], prompt_tokens: int,
         hit_tokens: int, on_started: Callable[[float], None] | None = None) -> OpenRequest:
    """A request sent to ``replica`` as the next decision must see it: its blocks predicted there
    and its prefill (the prompt less ``hit_tokens``) opened in the in-flight ledger. Called with
    the decision, before anything is awaited (``Forwarder.forward``; the endpoint picker alike)."""
    if hashes:
        index.predict(replica.replica_id, hashes, time.monotonic())
    return in_flight.open(replica, max(prompt_tokens - hit_tokens, 1), on_started, hashes, prompt_tokens)


@dataclass(frozen=True)
class Routed:
    """A request and where to send it: what the forwarding needs from the decision."""

    endpoint: str  # a key of ENDPOINTS
    body: bytes  # as the client sent it
    headers: dict[str, str]  # for the replica
    ranked: list[Replica]  # best first; tried in turn
    hashes: list[int]  # the prompt's block hashes, predicted on the replica tried (prefix policies)
    prompt_tokens: int
    predicted_hit_tokens: int  # of the first choice
    session: str | None
    router_ms: float  # the router's time from the body's last byte to the decision
    predicted_ttft_s: float | None = None  # for the first choice (predicted-ttft only), calibrated
    uncalibrated_ttft_s: float | None = None  # the same before calibration
    # Its measured TTFT teaches the calibration: it streams (the first token's arrival is seen
    # here) and its estimate rests on the replica's own measured rate (a borrowed or default rate's
    # error says nothing of the replica: a fresh pool's first requests ran 6x their estimate).
    calibrates: bool = False
    # Returns once the client has gone (client_watch.disconnect_of); None: not watched.
    client_left: Callable[[], Awaitable[None]] | None = None
    # For the client's response whoever answers (a tenant's rate-limit headers).
    reply_headers: dict[str, str] = field(default_factory=dict)
    # Told a replica's answer's status and its last USAGE_TAIL_BYTES once it ended (a tenant's
    # reservation settled with the usage reported).
    on_done: Callable[[int, bytes], None] | None = None
    # Told once the replica tried first counts the request as open (in_flight.InFlight): a turn
    # of the fair queue stops counting it as let through and unsent (fair_queue.Turn.sent).
    on_open: Callable[[], None] | None = None
    path: str | None = None  # on the replica, when not ENDPOINTS' (a stored response's id)


def replica_headers(
    client_headers: Mapping[str, str], replica_api_key: str | None, tenant: str | None = None
) -> dict[str, str]:
    """What goes to the replica: the body's type, what the client asked to pass through, the
    router's own key for the replicas (never the client's) and the tenant the router
    authenticated (never one the client named)."""
    headers = {"content-type": "application/json"}
    for name in ("accept", "x-request-id"):
        if name in client_headers:
            headers[name] = client_headers[name]
    return headers | trusted_headers(replica_api_key, tenant)


def trusted_headers(replica_api_key: str | None, tenant: str | None) -> dict[str, str]:
    """The headers a replica trusts because only the router sets them: the replicas' key and the
    tenant the router authenticated. The endpoint picker sets the same on the requests a gateway
    sends (router/ext_proc.py), over any copy the client sent."""
    headers = {}
    if replica_api_key:
        headers["authorization"] = f"Bearer {replica_api_key}"
    if tenant:
        headers[TENANT_HEADER] = tenant
    return headers


async def sent(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """``client.send(request, stream=True)``, where a replica that resets the connection as it is
    made is a ``httpx.ConnectError``, as a refused one is: anyio raises ``AttributeError`` then
    (its socket already gone), which would otherwise reach the client as a 500 instead of moving
    the request on to the next replica (docs/router.md, "Failures")."""
    try:
        return await client.send(request, stream=True)
    except AttributeError as exc:
        raise httpx.ConnectError(f"the connection was reset as it was made ({exc})", request=request) from exc


class Forwarder:
    def __init__(
        self,
        connect_timeout_s: float,
        policy: str,
        replicas: ReplicaSet,
        index: PrefixIndex,
        in_flight: InFlight,
        sessions: SessionMemory,
        metrics: RouterMetrics,
        calibration: TtftCalibration | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.calibration = calibration  # told each streamed first choice's measured TTFT
        self.policy = policy  # for the requests metric's label
        self.replicas = replicas
        self.index = index
        self.in_flight = in_flight
        self.sessions = sessions
        self.metrics = metrics
        self._client: httpx.AsyncClient | None = None
        # With requests held at zero replicas (router/activation.py): a draining last replica
        # is a failure too (502, held and retried by the router), not an answer for the client.
        self.draining_is_failure = False

    def open(self) -> None:
        limits = httpx.Limits(
            max_connections=1024, max_keepalive_connections=256, keepalive_expiry=30)
        timeout = httpx.Timeout(connect=self.connect_timeout_s, read=600.0, write=30.0, pool=30.0)
        self._client = httpx.AsyncClient(limits=limits, timeout=timeout)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def forward(self, routed: Routed) -> Response:
        """The client's response: the first replica's down the ranking that answers, a 502 when
        none does, or a 499 when the client left before the first byte.

        The first replica's share of the request (its predicted blocks in the index, its prefill in
        the in-flight ledger) is booked here, before anything is awaited: the forward runs as a
        task of its own, and booked there, neither would be seen by the decisions taken before
        that task first runs; in a burst, a group's requests arriving together would be spread
        over the replicas as if each were a new prefix (docs/router.md, "Predictions")."""
        booked = [self._book(routed, routed.ranked[0], 0)] if routed.ranked else []
        try:
            response = await unless_client_leaves(self._forward(routed, booked), routed.client_left)
        finally:
            for request in booked:  # the forward never began (the client left first)
                self.in_flight.close(request)
        if response.status_code == CLIENT_GONE:
            self.metrics.requests.labels("none", self.policy, str(CLIENT_GONE)).inc()
        if not isinstance(response, RelayResponse):  # no replica's answer (on_done is not told)
            response.headers.update(routed.reply_headers)
        return response

    def _book(self, routed: Routed, replica: Replica, attempt: int) -> OpenRequest:
        hit = routed.predicted_hit_tokens if attempt == 0 else 0
        return book(self.index, self.in_flight, replica, routed.hashes, routed.prompt_tokens, hit,
                    self._measure(routed, replica) if attempt == 0 else None)

    async def _forward(self, routed: Routed, booked: list[OpenRequest]) -> Response:
        """``booked``: the first attempt's request, taken (popped) as the attempt begins."""
        client = self._client
        assert client is not None, "forward before open"
        method, path = ENDPOINTS[routed.endpoint]
        path = routed.path or path
        last_error = "no replica answered"
        for attempt, replica in enumerate(routed.ranked):
            is_last = attempt == len(routed.ranked) - 1
            request = booked.pop() if attempt == 0 and booked else self._book(routed, replica, attempt)
            if routed.on_open is not None:
                routed.on_open()
            committed = False
            upstream: httpx.Response | None = None
            try:
                upstream = await sent(client, client.build_request(
                    method, replica.url + path, content=routed.body or None, headers=routed.headers))
                draining = upstream.status_code == 503 and upstream.headers.get(DRAINING_HEADER)
                if draining and (not is_last or self.draining_is_failure):
                    last_error = f"replica {replica.replica_id} is draining"
                    self.replicas.mark_draining(replica)
                    self.metrics.retries.labels("draining").inc()
                    continue
                if upstream.status_code >= 500 and upstream.status_code != 504 and not is_last:
                    last_error = f"replica {replica.replica_id} answered {upstream.status_code}"
                    self.metrics.retries.labels("status_5xx").inc()
                    continue
                chunks = upstream.aiter_raw()
                try:
                    first = await chunks.__anext__()
                except StopAsyncIteration:
                    first = b""
                # A chat stream's first chunk is the role, and a Responses stream's first events
                # say it was created: both sent before prefill.
                if routed.endpoint not in ("chat", "responses"):
                    request.first_byte()
                committed = True
            except (httpx.TransportError, httpx.StreamError) as exc:
                last_error = f"replica {replica.replica_id}: {type(exc).__name__}: {exc}"
                # Refused: nothing listens there. A timeout may be a pause: counted.
                self.replicas.mark_down(replica, at_once=isinstance(exc, httpx.ConnectError))
                reason = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"
                self.metrics.retries.labels(reason).inc()
                continue
            finally:
                if not committed:
                    self.in_flight.close(request)
                    if upstream is not None:
                        await upstream.aclose()
            self.sessions.remember(routed.session, replica.replica_id)
            status = str(upstream.status_code)
            self.metrics.requests.labels(replica.replica_id, self.policy, status).inc()
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
            out_headers["x-kvscale-replica"] = replica.replica_id
            out_headers["x-kvscale-router-ms"] = f"{routed.router_ms:.3f}"
            out_headers["x-kvscale-predicted-hit-tokens"] = str(routed.predicted_hit_tokens)
            out_headers.update(routed.reply_headers)
            if routed.predicted_ttft_s is not None and attempt == 0:
                # What the estimate said of the replica that answers: its error is measurable.
                out_headers["x-kvscale-predicted-ttft-ms"] = f"{routed.predicted_ttft_s * 1000:.1f}"
                if routed.uncalibrated_ttft_s is not None:
                    out_headers["x-kvscale-predicted-ttft-uncalibrated-ms"] = (
                        f"{routed.uncalibrated_ttft_s * 1000:.1f}")
            events = upstream.headers.get("content-type", "").startswith("text/event-stream")
            return RelayResponse(
                self._passthrough(first, chunks, upstream, request, events, routed.on_done),
                status_code=upstream.status_code,
                headers=out_headers,
            )
        self.metrics.requests.labels("none", self.policy, "502").inc()
        return openai_error(502, f"every replica tried failed: {last_error}", "bad_gateway")

    def _measure(self, routed: Routed, replica: Replica) -> Callable[[float], None] | None:
        """What to do with the request's measured TTFT: a (predicted, measured) pair for the
        calibration, when there is a prediction and the request ``calibrates``."""
        calibration = self.calibration
        predicted = routed.uncalibrated_ttft_s
        if calibration is None or predicted is None or not routed.calibrates:
            return None
        replica_id = replica.replica_id
        return lambda measured_s: calibration.observe(replica_id, predicted, measured_s)

    async def _passthrough(
        self,
        first: bytes,
        chunks: AsyncIterator[bytes],
        upstream: httpx.Response,
        request: OpenRequest,
        events: bool,
        on_done: Callable[[int, bytes], None] | None = None,
    ) -> AsyncIterator[bytes]:
        # The last bytes: 4 say whether a broken stream ended between two events; the usage
        # needs more.
        keep = USAGE_TAIL_BYTES if on_done is not None else 4
        tail = first[-keep:]
        try:
            if first:
                yield first
            async for chunk in chunks:
                request.first_byte()
                tail = (tail + chunk)[-keep:]
                yield chunk
        except (httpx.TransportError, httpx.StreamError) as exc:
            # Already committed: never retried, and never a clean end (relay.py).
            replica = request.replica.replica_id
            log.warning("replica %s broke off a response mid-way (%s: %s): the client gets %s",
                        replica, type(exc).__name__, exc,
                        "an error event" if events and at_event_boundary(tail) else "an aborted connection")
            if not (events and at_event_boundary(tail)):
                raise UpstreamBroke(replica) from exc
            yield error_event(f"replica {replica} failed while answering: {type(exc).__name__}")
        finally:
            self.in_flight.close(request)
            if on_done is not None:
                on_done(upstream.status_code, tail)
            await upstream.aclose()
