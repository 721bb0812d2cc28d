"""Draining on SIGTERM, for `kvscale serve` and `kvscale router` alike.

Kubernetes sends SIGTERM when a pod must go (rolling update, scale-in) and SIGKILL after the
pod's grace period. uvicorn alone stops listening at SIGTERM and cuts open streams after its
graceful timeout. Draining instead, at SIGTERM:

1. readiness fails at once (``/health`` answers 503), so the Service and routers stop sending;
2. new generate requests get 503 with the OpenAI error body and ``x-kvscale-draining: 1``, which a
   router takes as "retry elsewhere, and stop picking this one";
3. requests already in flight (streams included) run to their end, up to ``--shutdown-timeout``;
4. then uvicorn shuts down as usual (lifespan shutdown stops the engine) and the process exits 0.

SIGINT (Ctrl+C) keeps uvicorn's behaviour: stop now, a second one forces it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from kvscale.listen import ALL_IPV6, bind_all_addresses
from kvscale.request_limits import RequestLimitMiddleware, RequestLimits, http_protocol

logger = logging.getLogger("kvscale.drain")

DRAINING_HEADER = "x-kvscale-draining"
# The pods' grace period is 60 s (operator); leave room for a preStop sleep and the shutdown.
DEFAULT_SHUTDOWN_TIMEOUT_S = 45.0
_POLL_S = 0.05


@dataclass
class Drain:
    """Whether this process is draining, and how many guarded requests are still open."""

    draining: bool = False
    in_flight: int = 0
    started_at: float | None = None


def draining_response_parts() -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of the answer to a request that arrives while draining."""
    body = json.dumps({"error": {
        "message": "This server is shutting down and takes no new requests; retry on another replica.",
        "type": "server_error", "param": None, "code": "draining",
    }}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", b"1"), (DRAINING_HEADER.encode(), b"1"), (b"connection", b"close")]
    return 503, headers, body


class DrainMiddleware:
    """Plain ASGI: counts the open requests that ``guarded(method, path)`` selects and, once
    draining, answers new ones 503 instead of running them."""

    def __init__(self, app: Any, drain: Drain, guarded: Callable[[str, str], bool]) -> None:
        self.app = app
        self.drain = drain
        self.guarded = guarded

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.guarded(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            status, headers, body = draining_response_parts()
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM turned into: drain, wait for the open requests, then exit."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout_s: float, name: str) -> None:
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout_s = shutdown_timeout_s
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        if self.drain.draining:
            return  # already draining; Kubernetes follows up with SIGKILL if it must
        # A signal handler runs between two bytecodes of the loop's thread: hand over to the loop.
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self.drain.draining = True
        self.drain.started_at = time.monotonic()
        logger.warning("%s: SIGTERM: draining %d open request(s), up to %.0f s",
                       self.name, self.drain.in_flight, self.shutdown_timeout_s)
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout_s
        while self.drain.in_flight and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(_POLL_S)
        if self.drain.in_flight:
            logger.warning("%s: shutdown timeout: %d request(s) still open are cut",
                           self.name, self.drain.in_flight)
        else:
            logger.warning("%s: drained in %.1f s; shutting down", self.name,
                           time.monotonic() - (self.drain.started_at or deadline))
        # What is left of the budget goes to uvicorn's own wait for connections.
        self.config.timeout_graceful_shutdown = max(1, int(deadline - time.monotonic()))
        self.should_exit = True


def asgi_app(app: Any, limits: RequestLimits, gate: Callable[[Any], Any] | None = None) -> Any:
    """What uvicorn runs: ``app`` behind the body limits, behind ``gate`` (an ASGI middleware
    factory) when given: what the gate refuses is refused from the head, before any body byte
    is read."""
    limited = RequestLimitMiddleware(app, limits)
    return gate(limited) if gate is not None else limited


def serve(app: Any, drain: Drain, *, host: str | None, port: int, shutdown_timeout_s: float,
          name: str, log_level: str = "info", access_log: bool = True,
          limits: RequestLimits | None = None, gate: Callable[[Any], Any] | None = None) -> None:
    """``uvicorn.run`` with draining on SIGTERM; returns once the server has stopped.

    `host` None: every address of the pod, IPv4 and IPv6 (kvscale.listen); else only `host`.
    `limits` bound each request's head, body and upload time (kvscale.request_limits); `gate`
    wraps them (``asgi_app``).
    """
    limits = limits or RequestLimits()
    sockets = None
    if host is None:
        # uvicorn (through asyncio) would bind "::" IPv6-only: a socket of our own takes both.
        sockets = [bind_all_addresses(port)]
        host = sockets[0].getsockname()[0]
        logger.info("%s: listening on every address (%s), port %d", name,
                    "IPv4 and IPv6" if host == ALL_IPV6 else "IPv4 only", port)
    config = uvicorn.Config(asgi_app(app, limits, gate), host=host, port=port,
                            log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=max(1, int(shutdown_timeout_s)),
                            h11_max_incomplete_event_size=limits.max_head_bytes,
                            http=http_protocol())
    try:
        DrainingServer(config, drain, shutdown_timeout_s, name).run(sockets=sockets)
    finally:
        for sock in sockets or ():
            sock.close()
