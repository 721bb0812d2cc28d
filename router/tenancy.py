"""Who a request comes from and whether its tenant's limits let it in: what the router's
endpoints ask before routing (docs/router.md, "Tenants").

Without ``--tenants`` it is the single ``--api-key`` check and every request is let in. With it,
the admission gate (router/admission.py) has matched the key from the request's head and left the
tenant in the ASGI scope; a generation request is then charged to the tenant's window in Redis
(router/tenant_limiter.py) and answered 429 over a limit, and the tokens it reserved are settled
with the usage its answer reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvscale.router import rate_limits as rules
from kvscale.router.auth import bearer_digest, bearer_matches, check_api_key, key_digest
from kvscale.router.engine_priority import forwarded_priority, with_priority
from kvscale.router.errors import openai_error
from kvscale.router.metrics import RouterMetrics
from kvscale.router.shared_counters import SharedCounters
from kvscale.router.tenant_limiter import TenantLimiter
from kvscale.router.tenants import SCOPE_KEY, Tenant, TenantFile, TenantTable

# A request routed twice (a held request whose replica went away: router/app.py) is admitted once.
GRANT_KEY = "kvscale.tenant_grant"
UNAUTHORIZED = ("invalid or missing API key", "authentication_error", "invalid_api_key")


@dataclass(frozen=True)
class Grant:
    """A request let in: its tenant (None without --tenants), the rate-limit headers for the
    client, what to do with its answer's status and tail once it ends, and the body to send
    when not the client's (its tenant's priority set: router/engine_priority.py)."""

    tenant: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    on_done: Callable[[int, bytes], None] | None = None
    body: bytes | None = None


class Tenancy:
    def __init__(self, api_key: str | None, tenants: TenantFile | None, redis_url: str | None,
                 redis_timeout_s: float, metrics: RouterMetrics,
                 scheduling_policy: str = "fcfs", fair_queue: bool = False) -> None:
        self.api_key = api_key
        # The replicas' --scheduling-policy: under priority, a tenant's priority goes with its
        # requests (docs/router.md, "Priority on the replicas").
        self.engine_priority = scheduling_policy == "priority"
        self.tenants = tenants
        self.redis_url = redis_url
        self.redis_timeout_s = redis_timeout_s
        self.metrics = metrics
        self._limiter: TenantLimiter | None = None
        # With --max-queue-wait (``fair_queue``), the queue's counters, shared by the fleet's
        # routers through Redis (docs/router.md, "Fair share across routers").
        self.counters = SharedCounters(
            redis_url, redis_timeout_s, lambda shared: metrics.fair_share_shared.set(int(shared))
        ) if fair_queue and tenants is not None and redis_url else None
        self._series: set[str] = set()
        if tenants is not None:
            self._label(tenants.table)
            tenants.on_reload.append(self._label)

    def _label(self, table: TenantTable) -> None:
        """Series for the tenants of the file only (bounded), zero from the start; a tenant the
        file no longer lists leaves them."""
        names = set(table.names)
        for gone in self._series - names:
            self.metrics.tenant_requests.remove(gone)
            self.metrics.tenant_tokens.remove(gone)
            self.metrics.tenant_queue_wait.remove(gone)
            for kind in rules.LIMIT_KINDS:
                self.metrics.tenant_rate_limited.remove(gone, kind)
        for name in names:
            self.metrics.tenant_requests.labels(name)
            self.metrics.tenant_tokens.labels(name)
            self.metrics.tenant_queue_wait.labels(name)
            for kind in rules.LIMIT_KINDS:
                self.metrics.tenant_rate_limited.labels(name, kind)
        self._series = names

    @property
    def checks_keys(self) -> bool:
        return self.tenants is not None or bool(self.api_key)

    def identify(self, authorization: str) -> Tenant | None | JSONResponse:
        """Whom an Authorization header's value names: the tenant (with --tenants), None (no
        tenants: the --api-key matched, or none is set), or the 401 to answer with: what the
        HTTP port's handlers and the endpoint picker (router/ext_proc.py) ask of one table."""
        if self.tenants is None:
            if not self.api_key or bearer_matches(authorization, key_digest(self.api_key)):
                return None
            return openai_error(401, *UNAUTHORIZED)
        tenant = self.tenants.current().match(bearer_digest(authorization))
        return tenant if tenant is not None else openai_error(401, *UNAUTHORIZED)

    def authenticate(self, request: Request) -> JSONResponse | None:
        """None when the request may pass, else the 401 to answer with."""
        if self.tenants is None:
            return check_api_key(request, self.api_key)
        if SCOPE_KEY not in request.scope:  # the app served without the gate (tests, embedding)
            found = self.identify(request.headers.get("authorization", ""))
            request.scope[SCOPE_KEY] = found if isinstance(found, Tenant) else None
        return None if request.scope[SCOPE_KEY] is not None else openai_error(401, *UNAUTHORIZED)

    @staticmethod
    def tenant_of(request: Request) -> Tenant | None:
        tenant = request.scope.get(SCOPE_KEY)
        return tenant if isinstance(tenant, Tenant) else None

    async def admit(self, request: Request, endpoint: str, body: dict[str, Any],
                    prompt_tokens: int, body_bytes: int) -> Grant | Response:
        """Charge a generation request to its tenant's window: the grant, or the 429."""
        if isinstance(granted := request.scope.get(GRANT_KEY), Grant):
            return granted
        grant = await self.admit_tenant(self.tenant_of(request), endpoint, body, prompt_tokens, body_bytes)
        if isinstance(grant, Grant):
            request.scope[GRANT_KEY] = grant
        return grant

    async def admit_tenant(self, tenant: Tenant | None, endpoint: str, body: dict[str, Any],
                           prompt_tokens: int, body_bytes: int) -> Grant | Response:
        """``admit`` for a tenant already identified, once: what the endpoint picker asks."""
        if tenant is None:
            return Grant()
        grant = await self._admit(tenant, endpoint, body, prompt_tokens, body_bytes)
        if isinstance(grant, Grant):
            sent = forwarded_priority(tenant.priority, body) if self.engine_priority else None
            grant = replace(grant, on_done=self._counted(tenant.name, grant.on_done),
                            body=with_priority(body, sent) if sent is not None else None)
        return grant

    async def _admit(self, tenant: Tenant, endpoint: str, body: dict[str, Any],
                     prompt_tokens: int, body_bytes: int) -> Grant | Response:
        self.metrics.tenant_requests.labels(tenant.name).inc()
        if not tenant.limited:
            return Grant(tenant.name)
        cost = rules.request_tokens(endpoint, body, prompt_tokens, body_bytes)
        counts = await self._limiter_now().admit(tenant, cost) if self.redis_url else None
        if counts is None:
            if not self.redis_url:
                self.metrics.tenant_limits_unchecked.inc()  # a reload added limits without Redis
            return Grant(tenant.name)
        headers = rules.headers(tenant, counts)
        if counts.over:
            self.metrics.tenant_rate_limited.labels(tenant.name, counts.over).inc()
            refused = openai_error(429, rules.refusal_message(tenant, counts, cost), counts.over,
                                   "rate_limit_exceeded")
            if not rules.too_large(tenant, cost):
                headers["retry-after"] = str(rules.retry_after_s(counts.reset_ms))
            refused.headers.update(headers)
            return refused
        limiter = self._limiter_now()

        def settle(status: int, tail: bytes) -> None:
            delta = rules.settlement(cost, rules.usage_tokens(tail), status)
            limiter.correct(tenant.name, counts.window, delta)

        return Grant(tenant.name, headers, settle if tenant.tokens_per_minute else None)

    def _counted(self, tenant: str, on_done: Callable[[int, bytes], None] | None
                 ) -> Callable[[int, bytes], None]:
        """``on_done`` after counting the tokens the answer's usage reports to the tenant."""
        def counted(status: int, tail: bytes) -> None:
            if (used := rules.usage_tokens(tail)) is not None:
                self.metrics.tenant_tokens.labels(tenant).inc(used)
            if on_done is not None:
                on_done(status, tail)

        return counted

    def _limiter_now(self) -> TenantLimiter:
        """Made on first use, on the event loop that serves (its client belongs to that loop)."""
        if self._limiter is None:
            assert self.redis_url is not None
            self._limiter = TenantLimiter(self.redis_url, self.redis_timeout_s,
                                          self.metrics.tenant_limits_unchecked.inc)
        return self._limiter

    async def close(self) -> None:
        if self._limiter is not None:
            await self._limiter.close()
        if self.counters is not None:
            await self.counters.close()
