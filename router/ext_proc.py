"""The router as a Gateway API Inference Extension endpoint picker: `kvscale router --ext-proc-port`.

A gRPC server for Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` beside the
router's HTTP port, in the same process and on the same event loop, so that it reads the same
state without locks: the replicas (discovery, health checks, Redis heartbeats), the prefix index,
the load. Each request is ranked by the same steps the HTTP path takes (the router's candidates,
its prefix hasher, its ``Decider``); the gateway then sends the request where the answer says
(kvscale.router.ext_proc_messages has the protocol). What a routed request adds to the router's
bookkeeping is what the HTTP path adds when it sends one: a predicted prefix on the first choice,
an open request on it until the gateway closes the request's stream (its prefill done once the
response's headers pass, which the gateway sends when ``response_header_mode`` is SEND), the
session's replica.

With ``--max-queue-wait`` a ranked request takes its turn in the HTTP port's fair queue
(kvscale.router.fair_queue.tenant_turn): its message stays unanswered while it waits, so the
gateway holds it; past the wait it gets the HTTP port's 503; its slot is given back when its
stream ends, and a stream the gateway resets while it waits (its client left) leaves the queue.

Tenants (``--api-key``, ``--tenants``) are the HTTP port's own (kvscale.router.tenancy): the key
checked from the request's head (401), the tenant's limits counted in Redis (429 with the same
headers), and the request changed as the router would forward it: the trusted headers set, a
client's copy removed, the body with its tenant's priority. The reservation is settled when the
stream ends, with the usage when the gateway sends the response body, else by its status
(docs/gateway.md, "Tenants").

The gRPC runtime is grpcio (with grpcio-health-checking for the health services gateways probe:
``liveness``, ``readiness`` and the ext_proc service's own name); the Envoy API messages come from
``xds-protos`` (see kvscale.router.ext_proc_messages for why that package).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from starlette.responses import Response

from kvscale.drain import Drain
from kvscale.router import ext_proc_messages as msg
from kvscale.router import policy as routing
from kvscale.router.admission import is_open
from kvscale.router.client_watch import CLIENT_GONE
from kvscale.router.errors import openai_error, request_json
from kvscale.router.fair_queue import Turn, tenant_turn
from kvscale.router.fleet_room import room_on, running_on
from kvscale.router.in_flight import OpenRequest
from kvscale.router.lora_routing import request_adapter
from kvscale.router.prefix_hashes import PromptBlocks
from kvscale.router.proxy import book, trusted_headers
from kvscale.router.rate_limits import USAGE_TAIL_BYTES
from kvscale.router.replicas import Replica
from kvscale.router.tenancy import Grant
from kvscale.router.tenants import Tenant
from kvscale.tenant_limits_schema import TENANT_HEADER

log = logging.getLogger("kvscale.router.ext_proc")

# The generation paths the router ranks by prompt; any other path goes to the least busy replica.
ENDPOINT_OF_PATH = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                    "/v1/responses": "responses"}
# gRPC's own cap on one message, above the body cap: the headers and framing around a body.
MESSAGE_HEADROOM_BYTES = 1 << 20


@dataclass(frozen=True)
class Picked:
    endpoints: list[str]  # ip:port, in retry order
    opened: OpenRequest  # on the first choice, closed when the request's stream ends
    grant: Grant = field(default_factory=Grant)  # its tenant's: rate-limit headers
    forwarded: msg.Forwarded = msg.UNCHANGED
    # Told at the stream's end: the tenant's settlement, then the fair queue's turn (its slot).
    on_done: Callable[[int, bytes], None] | None = None


@dataclass
class Stream:
    """One request's ext_proc stream: the exchange, whom its key named, where it went, and what
    the gateway showed of the answer (its status; its body's tail when the gateway sends the
    response body)."""

    exchange: msg.Exchange
    tenant: Tenant | None = None
    picked: Picked | None = None
    status: int = 0
    tail: bytes = b""

    def settle(self) -> None:
        """The tenant's reservation settled as the HTTP path settles it (rate_limits.settlement):
        with the usage in the answer's tail, else by its status; no answer seen (the client or
        the gateway left first) keeps it, as a client gone does. Its turn in the fair queue ends
        with it, which offers its slot to whoever waits."""
        if self.picked is not None and self.picked.on_done is not None:
            self.picked.on_done(self.status or CLIENT_GONE, self.tail)


def endpoint_of(url: str) -> str:
    """A replica's ``host:port`` from its base URL (http://10.0.0.7:8000 -> 10.0.0.7:8000): what
    an ORIGINAL_DST cluster connects to, so replicas must be known by address, as discovery gives."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def refusal_of(response: Response) -> msg.Refusal:
    """The HTTP port's error answer as an immediate response: its status, body and headers
    (``Retry-After``, rate limits; not those the gateway writes itself)."""
    headers = tuple((k, v) for k, v in response.headers.items() if k not in ("content-length", "content-type"))
    return msg.Refusal(response.status_code, bytes(response.body), headers)


def forwarded_of(router: Any, tenant: Tenant | None, grant: Grant) -> msg.Forwarded:
    """What the replica must get as the HTTP port would send it (kvscale.router.proxy): the
    replicas' key and the authenticated tenant set, a client's copy of either removed, the body
    with its tenant's priority."""
    config = router.config
    trusted = trusted_headers(config.replica_api_key, tenant.name if tenant is not None else None)
    removed = [TENANT_HEADER]
    if router.tenancy.checks_keys:  # the client's key is the router's, never a replica's
        removed.append("authorization")
    return msg.Forwarded(trusted, tuple(h for h in removed if h not in trusted), grant.body)


def parse_body(raw: bytes) -> dict[str, Any] | msg.Refusal:
    """The request's JSON object, checked as the HTTP path checks it; an empty body is ``{}``."""
    if not raw:
        return {}
    body = request_json(raw)
    return refusal_of(body) if isinstance(body, Response) else body


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """``Process``: one stream per HTTP request, answered from ``router``'s state (a
    kvscale.router.app.Router, started)."""

    def __init__(self, router: Any, max_body_bytes: int) -> None:
        self.router = router
        self.max_body_bytes = max_body_bytes

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        stream = Stream(msg.Exchange(self.max_body_bytes))
        try:
            async for request in request_iterator:
                answers = await self._answer(stream, request)
                for answer in answers:
                    yield answer
                if answers and answers[-1].HasField("immediate_response"):
                    return
        finally:
            if stream.picked is not None:
                self.router.in_flight.close(stream.picked.opened)
                stream.settle()

    async def _answer(self, stream: Stream, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        exchange = stream.exchange
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            exchange.take_headers(request)
            if (refused := self._authenticate(stream)) is not None:  # from the head, as the HTTP port
                return [msg.immediate(refused)]
            if request.request_headers.end_of_stream:  # no body: decided on the headers alone
                return await self._decide(stream, lambda p: [msg.headers_routed(p.endpoints, p.forwarded)])
            return [] if exchange.full_duplex else [msg.headers_unchanged()]
        if kind == "request_body":
            chunk = request.request_body
            if not exchange.add_chunk(chunk.body):
                message = f"the request body is over {self.max_body_bytes} bytes"
                return [msg.immediate(refusal_of(openai_error(413, message, "invalid_request_error")))]
            if exchange.decided:
                return [msg.body_unchanged()]
            if chunk.end_of_stream:
                return await self._decide(
                    stream, lambda p: msg.routed_answers(exchange, p.endpoints, forwarded=p.forwarded))
            # FULL_DUPLEX_STREAMED: gathered until the last chunk. Another mode's partial chunk
            # (STREAMED) goes on as it is; its request is decided at its end.
            return [] if exchange.full_duplex else [msg.body_unchanged()]
        if kind == "request_trailers":
            if exchange.full_duplex and not exchange.decided:  # the body ended with trailers
                return await self._decide(
                    stream, lambda p: msg.routed_answers(exchange, p.endpoints, trailers=True, forwarded=p.forwarded))
            return [msg.trailers_unchanged()]
        if kind == "response_headers" and stream.picked is not None:
            # A replica sends a stream's headers with its first token (and a whole answer's at its
            # end): the prefill is done, as the HTTP path learns from the first byte.
            stream.picked.opened.first_byte()
            stream.status = msg.response_status(request.response_headers)
            if stream.picked.grant.headers:
                return [msg.response_headers_added(stream.picked.grant.headers)]
        if kind == "response_body":  # sent only by a gateway told to: the usage is near the end
            stream.tail = (stream.tail + request.response_body.body)[-USAGE_TAIL_BYTES:]
        answer = msg.passthrough_answer(request)
        return [answer] if answer is not None else []

    def _authenticate(self, stream: Stream) -> msg.Refusal | None:
        """The key in the request's head, checked as the HTTP port's gate checks it (probes
        open): the tenant it names kept for the decision, or the 401."""
        tenancy = self.router.tenancy
        headers = stream.exchange.headers
        if not tenancy.checks_keys or is_open(headers.get(":method", ""), stream.exchange.path):
            return None
        found = tenancy.identify(headers.get("authorization", ""))
        if isinstance(found, Response):
            return refusal_of(found)
        stream.tenant = found
        return None

    async def _decide(self, stream: Stream, answers: Callable[[Picked], list[pb.ProcessingResponse]]
                      ) -> list[pb.ProcessingResponse]:
        exchange = stream.exchange
        exchange.decided = True
        result = await pick(self.router, exchange.path, exchange.headers, exchange.body(), stream.tenant)
        if isinstance(result, msg.Refusal):
            return [msg.immediate(result)]
        stream.picked = result
        return answers(result)


async def pick(router: Any, path: str, headers: dict[str, str], raw: bytes,
               tenant: Tenant | None = None) -> Picked | msg.Refusal:
    """Where a request goes: the HTTP path's candidates, prompt hashes, tenant's admission (the
    429 over its limits), turn in the fair queue (held while the replicas have no room, the 503
    past --max-queue-wait) and decision, then what sending it there records
    (kvscale.router.app.Router.route and the Forwarder do the same)."""
    started = time.perf_counter()
    body = parse_body(raw)
    if isinstance(body, msg.Refusal):
        return body
    model = body.get("model")
    candidates = router._candidates(model)
    if isinstance(candidates, Response):
        return refusal_of(candidates)
    config = router.config
    endpoint = ENDPOINT_OF_PATH.get(path)
    prompt = PromptBlocks([], 0, config.block_size)
    grant = Grant(tenant.name if tenant is not None else None)
    adapter = None
    turn = Turn(None)
    if endpoint is not None:
        adapter = request_adapter(model, candidates, router.heartbeats.get, router.hasher.tokenizers)
        if routing.uses_prefix(config.policy):
            prompt = await router._prompt_blocks(endpoint, body, model, len(raw), adapter)
        admitted = await router.tenancy.admit_tenant(tenant, endpoint, body, prompt.prompt_tokens, len(raw))
        if isinstance(admitted, Response):  # over the tenant's limits: 429
            return refusal_of(admitted)
        grant = admitted
        queued = await tenant_turn(router.queue, tenant, endpoint, body, prompt.prompt_tokens, len(raw),
                                   lambda: room_on(candidates, router.heartbeats, router.in_flight), grant,
                                   running=lambda: running_on(candidates, router.heartbeats))
        if isinstance(queued, Response):  # waited --max-queue-wait: the HTTP port's 503
            return refusal_of(queued)
        turn = queued
    with turn:  # an exception before the answer ends the turn (fair_queue.Turn)
        session = headers.get(config.session_header) if config.session_header else None
        hit_tokens = 0
        if endpoint is None:  # /tokenize and the like: the least busy, as the HTTP path's pass-through
            ranked: list[Replica] = sorted(candidates, key=lambda r: r.in_flight)
            session = None
        else:
            decision, hit_tokens = router.decided(candidates, prompt, model, body, session, adapter, started)
            by_id = {r.replica_id: r for r in candidates}
            ranked = [by_id[rid] for rid in decision.ranked]
        ranked = ranked[: max(1, config.max_attempts)]
        first = ranked[0]
        opened = book(router.index, router.in_flight, first, prompt.hashes, prompt.prompt_tokens, hit_tokens)
        router.decider.sessions.remember(session, first.replica_id)
        # From here the replica's count has it; its end, as the gateway shows it, settles both.
        return Picked([endpoint_of(r.url) for r in ranked], opened, grant, forwarded_of(router, tenant, grant),
                      turn.forwarding(grant.on_done))


def bind_address(host: str | None, port: int) -> str:
    if host is None:
        return f"[::]:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def follow_drain(health: health_aio.HealthServicer, drain: Drain, every_s: float = 0.25) -> None:
    """Once the router drains (SIGTERM), every health name but ``liveness`` answers NOT_SERVING,
    so that gateways probing them turn to another picker; ``Process`` still answers meanwhile."""
    while not drain.draining:
        await asyncio.sleep(every_s)
    for name in ("", *msg.HEALTH_SERVICES):
        if name != "liveness":
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def start_server(router: Any, host: str | None, port: int, max_body_bytes: int
                       ) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    limit = max_body_bytes + MESSAGE_HEADROOM_BYTES
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", limit)])
    pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(router, max_body_bytes), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", *msg.HEALTH_SERVICES):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = bind_address(host, port)
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"kvscale router: --ext-proc-port: cannot listen on {address}")
    await server.start()
    log.info("endpoint picker (Envoy ext_proc, gRPC) listening on %s", address)
    return server, health


def serve_beside(app: Any, host: str | None, port: int, max_body_bytes: int) -> None:
    """Run the picker for the life of ``app`` (the router's Starlette app): started once the
    router is (tokenizers loaded, Redis feed open), stopped before it stops."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(started_app: Any) -> AsyncIterator[None]:
        async with inner(started_app):
            server, health = await start_server(started_app.state.router, host, port, max_body_bytes)
            draining = asyncio.create_task(follow_drain(health, started_app.state.drain), name="picker-drain")
            try:
                yield
            finally:
                draining.cancel()
                await server.stop(grace=1.0)

    app.router.lifespan_context = lifespan
