"""The tenant a request came from, as the router names it, and when a replica believes it.

The router authenticates a tenant by its own key and forwards the tenant's name in
``x-kvscale-tenant`` (kvscale.tenant_limits_schema.TENANT_HEADER), with the replicas' key
(``kvscale router --replica-api-key``) in place of the client's. A replica honours the header
only when it requires a key itself (``kvscale serve --api-key``): every request that reaches
the handlers then carried that key, which only the router holds, so nobody else can name a
tenant. A replica without a key ignores the header, whoever sends it (docs/server.md,
"Tenants"). The tenant is the outer level of fair admission (server/core/admission_order.py).

Plain ASGI, like the key check it sits behind, so streamed responses pass through untouched; the
tenant reaches ``OpenAIServer.open_streams`` through a context variable, set for the request's
own task only.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from kvscale.tenant_limits_schema import TENANT_HEADER

# A tenant's name is at most 63 characters in the router's tenants file; a longer value is not
# one the router sent, and is ignored rather than kept in the engine's queue.
MAX_TENANT_CHARS = 63
_HEADER = TENANT_HEADER.encode()

# The tenant of the request this task serves; "" for none.
REQUEST_TENANT: ContextVar[str] = ContextVar("kvscale_request_tenant", default="")


def tenant_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The tenant the header names: its first value if it is a plausible name, else ""."""
    for name, value in headers:
        if name == _HEADER:
            tenant = value.decode("latin-1").strip()
            return tenant if 0 < len(tenant) <= MAX_TENANT_CHARS and tenant.isprintable() else ""
    return ""


class TenantMiddleware:
    """Sets REQUEST_TENANT from the header. Installed only on a server with an API key, inside
    the key check, so only requests that authenticated with the key get here."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = REQUEST_TENANT.set(tenant_of(scope.get("headers") or []))
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_TENANT.reset(token)
