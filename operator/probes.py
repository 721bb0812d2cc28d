"""The operator's HTTP port: /metrics, and /healthz that fails when the loop it vouches for is stuck.

/metrics alone made a poor liveness probe: it is served from a thread of its own, which answers
while the kopf event loop is wedged. /healthz answers from the same thread but reports the age
of a `Heartbeat` that the working loop beats: the leader election while this process waits to
lead, the kopf event loop once it leads. A heartbeat older than `max_age_s` is 503, and so is
any added check that names a stall: the periodic loops' (periodic.stalled), which run on threads
of their own and could stop while the event loop turns.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Three missed liveness periods of 10 s would restart the pod anyway; a loop silent for this long
# is stuck, not busy.
DEFAULT_MAX_AGE_S = 30.0
BEAT_INTERVAL_S = 1.0


class Heartbeat:
    def __init__(self, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self.last = time.monotonic()
        self.source = "start-up"
        self._lock = threading.Lock()
        self._checks: list[Callable[[], str | None]] = []

    def add_check(self, check: Callable[[], str | None]) -> None:
        """`check()` names a stall (503 with its words) or returns None."""
        self._checks.append(check)

    def beat(self, source: str) -> None:
        with self._lock:
            self.last, self.source = time.monotonic(), source

    def verdict(self) -> tuple[bool, str]:
        with self._lock:
            age, source = time.monotonic() - self.last, self.source
        if age > self.max_age_s:
            return False, f"{source}: no progress for {age:.0f} s (limit {self.max_age_s:.0f} s)\n"
        for check in list(self._checks):
            stall = check()
            if stall:
                return False, stall + "\n"
        return True, f"ok ({source}, {age:.1f} s ago)\n"


async def beat_forever(heartbeat: Heartbeat, source: str = "kopf event loop") -> None:
    """A task on the loop being vouched for: it runs only while that loop does."""
    while True:
        heartbeat.beat(source)
        await asyncio.sleep(BEAT_INTERVAL_S)


def serve(port: int, host: str, registry: CollectorRegistry,
          heartbeat: Heartbeat) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve /metrics and /healthz on their own daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok, text = heartbeat.verdict()
                self._answer(200 if ok else 503, text.encode(), "text/plain; charset=utf-8")
            else:
                self._answer(404, b"not found\n", "text/plain; charset=utf-8")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass  # every probe and scrape would be a log line

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def server_bind(self) -> None:
            if self.address_family == socket.AF_INET6:
                # "::" takes IPv4 too, whatever net.ipv6.bindv6only says (kvscale.listen).
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    server = Server((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="operator-http", daemon=True)
    thread.start()
    return server, thread
