"""What the router lets in before it reads a request's body: the client's key, a bound on the
requests open at once, and a budget of request-body bytes held over all of them.

Plain ASGI, outside the body limits (kvscale.request_limits, which read each body whole): a
request without the key is answered 401 from its head, its body never read; one over the bound
on open requests, or whose body would take the bytes held past the budget, gets 503 with
``Retry-After``: from its head when its declared Content-Length does not fit beside the bytes
held now, else as its bytes arrive. Only bytes that arrived count (a client that announces a
large body and sends nothing reserves nothing), until the response ends (the router holds the
body that long). So the router's memory for bodies is bounded whatever the number of connections
(docs/router.md, "Limits"). Probes and scrapers (``OPEN_PATHS``) pass untouched: a router under
load stays ready.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvscale.request_limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from kvscale.router.auth import bearer_digest, bearer_matches, key_digest
from kvscale.router.tenants import SCOPE_KEY

if TYPE_CHECKING:
    from kvscale.router.config import RouterConfig
    from kvscale.router.tenants import TenantFile

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
DEFAULT_MAX_OPEN_REQUESTS = 2048
# Two bodies of the largest size a request may have (--max-request-body-bytes): parsed, a body
# takes several times its bytes (a list of token ids ~6x), and the router's default memory
# limit is 1 Gi.
DEFAULT_BODY_BUDGET_BYTES = 2 * DEFAULT_MAX_BODY_BYTES
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class AdmissionLimits:
    api_key: str | None = None
    max_open_requests: int = DEFAULT_MAX_OPEN_REQUESTS
    body_budget_bytes: int = DEFAULT_BODY_BUDGET_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # one body's (larger: 413 from the body limits)
    tenants: TenantFile | None = None  # a key per tenant instead of api_key


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    err_type: str
    code: str


def is_open(method: str, path: str) -> bool:
    """Probes and scrapers: no key, never counted."""
    return method == "GET" and path in OPEN_PATHS


def is_api_request(method: str, path: str) -> bool:
    """What a draining router turns away (kvscale.drain.DrainMiddleware)."""
    return method == "POST" and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize"))


def refusal(limits: AdmissionLimits, *, key_ok: bool, open_requests: int, held_bytes: int,
            declared_bytes: int) -> Refusal | None:
    """Why a request that just arrived (its head read) is turned away, or None to admit it."""
    if not key_ok:
        return Refusal(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
    if open_requests >= limits.max_open_requests:
        return Refusal(503, f"the router has {open_requests} requests open, its limit "
                       "(--max-open-requests); retry shortly", "service_unavailable", "overloaded")
    if declared_bytes <= limits.max_body_bytes and held_bytes + declared_bytes > limits.body_budget_bytes:
        return over_budget(limits)
    return None


def over_budget(limits: AdmissionLimits) -> Refusal:
    return Refusal(503, f"the request bodies this router holds would pass its budget of "
                   f"{limits.body_budget_bytes} bytes (--max-body-bytes-in-flight); retry shortly",
                   "service_unavailable", "overloaded")


def response_parts(refused: Refusal) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"message": refused.message, "type": refused.err_type,
                                 "param": None, "code": refused.code}}).encode()
    # The body is never read: the connection cannot carry another request.
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if refused.status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    return headers, body


class OverBudget(Exception):
    """A chunked body's bytes passed the budget as they arrived."""


class Admission:
    """The ASGI gate: wraps the body limits, which wrap the router's app."""

    def __init__(self, app: Any, limits: AdmissionLimits) -> None:
        self.app = app
        self.limits = limits
        self._digest = key_digest(limits.api_key) if limits.api_key else None
        self.open_requests = 0
        self.held_bytes = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or is_open(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        try:
            declared = max(0, int(headers.get(b"content-length", b"0")))
        except ValueError:
            declared = 0  # the body limits answer it 400
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if self.limits.tenants is not None:
            # The tenant goes to the app in the scope (router/tenancy.py), None: no tenant's key.
            scope[SCOPE_KEY] = self.limits.tenants.current().match(bearer_digest(authorization))
            key_ok = scope[SCOPE_KEY] is not None
        else:
            key_ok = self._digest is None or bearer_matches(authorization, self._digest)
        refused = refusal(self.limits, key_ok=key_ok, open_requests=self.open_requests,
                          held_bytes=self.held_bytes, declared_bytes=declared)
        if refused is not None:
            await _answer(send, refused)
            return
        self.open_requests += 1
        held = 0
        started = False

        async def counted_receive() -> dict:
            nonlocal held
            message = await receive()
            arrived = len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if arrived:
                if self.held_bytes + arrived > self.limits.body_budget_bytes:
                    raise OverBudget
                self.held_bytes += arrived
                held += arrived
            return message

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except OverBudget:
            if started:
                raise
            await _answer(send, over_budget(self.limits))
        finally:
            self.open_requests -= 1
            self.held_bytes -= held


async def _answer(send: Any, refused: Refusal) -> None:
    headers, body = response_parts(refused)
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def gate(config: RouterConfig, limits: RequestLimits) -> Callable[[Any], Admission]:
    """The router's gate around the body limits (kvscale.drain.asgi_app)."""
    admission = AdmissionLimits(config.api_key, config.max_open_requests, config.body_budget_bytes,
                                limits.max_body_bytes, config.tenants)
    return lambda inner: Admission(inner, admission)
