"""The router's ASGI app: the parts wired together, their lifecycle, and the HTTP endpoints.

Per request: parse the body, hash the prompt's full blocks (``prefix_hashes``), rank the
replicas (``decision``, ``policy``), then forward down the ranking (``proxy``). Heartbeats from
Redis (``redis_feed``, ``heartbeats``) and health checks (``replicas``) say who is routable.
It is over 400 lines: every endpoint's steps read the same parts' state, so they stay on one
class; each decision they take lives in a pure module of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvscale.drain import Drain, DrainMiddleware
from kvscale.processes import freeze_startup_heap
from kvscale.router import activation as holding
from kvscale.router import policy as routing
from kvscale.router import responses
from kvscale.router import status_endpoints as status
from kvscale.router.admission import is_api_request
from kvscale.router.client_watch import disconnect_of
from kvscale.router.config import RouterConfig
from kvscale.router.decision import Decider
from kvscale.router.errors import not_found, openai_error, request_json
from kvscale.router.fair_queue import FairQueue, queued_turn
from kvscale.router.fleet_room import room_on, running_on
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.hold_gate import (
    activation_report,
    can_take,
    hold_until_ready,
    refusal,
    worth_holding,
)
from kvscale.router.in_flight import InFlight
from kvscale.router.index import PrefixIndex
from kvscale.router.lora_fanout import update_routes
from kvscale.router.lora_replay import RuntimeAdapters
from kvscale.router.lora_routing import Adapter, request_adapter, serves
from kvscale.router.metrics import RouterMetrics
from kvscale.router.prefix_hashes import PrefixHasher, PromptBlocks
from kvscale.router.proxy import Forwarder, Routed, replica_headers
from kvscale.router.replicas import EndpointSliceWatch, Replica, ReplicaSet
from kvscale.router.tenancy import Tenancy

log = logging.getLogger("kvscale.router")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        if config.policy not in routing.POLICIES:
            choices = ", ".join(routing.POLICIES)
            raise ValueError(f"unknown routing policy {config.policy!r}; choose one of {choices}")
        self.config = config
        self.metrics = RouterMetrics(config.policy)
        self.tenancy = Tenancy(config.api_key, config.tenants, config.redis_url,
                               config.redis_timeout_ms / 1000.0, self.metrics, config.scheduling_policy, bool(config.max_queue_wait_s))
        # Without Redis the index is only the router's own decisions; keep them until capacity.
        self.index = PrefixIndex(prediction_ttl_s=(1e9 if config.redis_url is None else 10.0))
        # A replica discovery drops (its pod NotReady or deleted) leaves the index, the ledgers, the
        # heartbeat table and the metrics' series at once.
        self.replicas = ReplicaSet(
            api_key=config.replica_api_key, health_interval_s=config.health_interval_s,
            on_removed=lambda replica: self.decider.forget(replica.replica_id),
            on_renamed=lambda old, new: self.decider.renamed(old, new))
        self.replicas.set_urls(config.replicas)
        self.heartbeats = HeartbeatTable()
        self.hasher = PrefixHasher(
            config.models, config.block_size, config.chat_cache_tokens,
            on_fallback=lambda reason: self.metrics.fallbacks.labels(reason).inc(),
            served_names=config.served_model_names, tool_format=config.tool_call_parser,
        )
        for model in config.models:  # 0 until start() has loaded it
            for name in self.hasher.names_of(model):
                self.metrics.tokenizer_loaded.labels(name).set(0)
        self.in_flight = InFlight(self.metrics.in_flight)
        self.decider = Decider(config, self.index, self.heartbeats, self.in_flight, self.metrics)
        self.forwarder = Forwarder(
            config.connect_timeout_s, config.policy, self.replicas, self.index, self.in_flight,
            self.decider.sessions, self.metrics, self.decider.calibration,
        )
        self.activation: holding.Activation | None = None
        # Adapters loaded at run time through the fleet's routers (--allow-runtime-lora-updating,
        # set by lora_fanout.update_routes): held for at zero replicas as the served names are.
        self.runtime_adapters: RuntimeAdapters | None = None
        if config.hold_timeout_s is not None:
            wake = None
            if config.scale_from_zero:
                from kvscale.router.wake import ScaleFromZero

                wake = ScaleFromZero(config.scale_from_zero, config.namespace, self.metrics)
            self.activation = holding.Activation(
                holding.HoldLimits(config.hold_timeout_s, config.hold_queue), self.metrics, wake)
            self.forwarder.draining_is_failure = True
        self.queue = (FairQueue(config.max_queue_wait_s, self.metrics, shared=self.tenancy.counters,
                                replicas_preempt=config.scheduling_policy == "priority")
                      if config.max_queue_wait_s else None)
        self._watch: EndpointSliceWatch | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self.drain = Drain()  # flipped by SIGTERM (kvscale.drain.serve)
        self._started = time.monotonic()
        # Stored /v1/responses, read to route a conversation's next turn by its whole prompt.
        self.conversations = responses.StoredConversations(
            config.redis_url, config.redis_timeout_ms / 1000.0, self.metrics.redis_errors.inc,
        ) if config.redis_url else None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self.hasher.load_tokenizers)
        for name, error in self.hasher.tokenizer_status().items():
            self.metrics.tokenizer_loaded.labels(name).set(0 if error else 1)
        self.forwarder.open()
        if self.config.redis_url:
            from kvscale.router.redis_feed import RedisFeed

            feed = RedisFeed(
                self.config.redis_url,
                self.index,
                timeout_s=self.config.redis_timeout_ms / 1000.0,
                on_error=self.metrics.redis_errors.inc,
            )
            self.heartbeats.feed = feed
            await feed.start()
        else:
            log.warning("no --redis: the prefix index lives in this router process only, "
                        "built from its own decisions")
        if self.config.k8s_service or self.config.k8s_namespace_wide:
            self._watch = EndpointSliceWatch(
                self.config.k8s_service,
                self.config.namespace,
                self.replicas.set_urls,
                asyncio.get_running_loop(),
                port_name=self.config.k8s_port_name,
            )
            self._watch.start()
        await self.replicas.start()
        self._sync_task = asyncio.create_task(self._sync_loop(), name="router-sync")
        if self.config.freeze_heap_after_start:
            # Tokenizers pull in transformers (and torch, where installed): without this a full GC
            # stalls routing ~200 ms.
            freeze_startup_heap()

    async def stop(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
        if self.activation is not None:
            await self.activation.stop()
        if self._watch is not None:
            self._watch.stop()
        await self.replicas.stop()
        if self.heartbeats.feed is not None:
            await self.heartbeats.feed.stop()
        await self.forwarder.close()
        await self.tenancy.close()
        if self.conversations is not None:
            await self.conversations.close()

    async def _sync_loop(self) -> None:
        while True:
            self.sync_heartbeats()
            await asyncio.sleep(0.25)

    def sync_heartbeats(self) -> None:
        """Fold heartbeats into the replica table and refresh the gauges."""
        self.heartbeats.fold_into(self.replicas, self.hasher.block_sizes)
        feed = self.heartbeats.feed
        self.metrics.redis_up.set(1 if (feed is not None and feed.healthy) else 0)
        self.metrics.replicas_healthy.set(sum(1 for r in self.replicas.replicas.values() if self.heartbeats.routable(r)))
        self.metrics.set_index_blocks(self.index.sizes())
        if self.activation is not None:
            self.activation.update(self._any_available())

    def _any_available(self, model: str | None = None) -> bool:
        """A replica can take a request for ``model`` (None: any) now: what `_candidates` accepts."""
        return can_take(self.replicas.replicas.values(), model, self.heartbeats.get, self.heartbeats.routable)

    async def _hold(self, request: Request, model: str | None) -> Response | None:
        if self.activation is None:
            return None
        runtime = self.runtime_adapters.adapters if self.runtime_adapters is not None else ()
        return await hold_until_ready(self.activation, request, model, self._any_available,
                                      worth_holding=worth_holding(model, self.config, self._any_available(), runtime),
                                      refuse=self._hold_refused)

    def _hold_refused(self, message: str) -> Response:
        assert self.activation is not None
        self.metrics.requests.labels("none", self.config.policy, "503").inc()
        return refusal(self.activation, message)

    def activation_report(self) -> dict[str, Any]:
        """What the operator reads from /health (kvscale.router.hold_gate.activation_report)."""
        return activation_report(self.activation, list(self.replicas.replicas.values()), self._started)

    # -- HTTP ------------------------------------------------------------------------------------
    async def _read(self, request: Request) -> tuple[bytes, dict[str, Any], float] | Response:
        """The request's body, its parsed JSON object and when the router's own time started,
        or the error answering it."""
        if (denied := self.tenancy.authenticate(request)) is not None:
            return denied
        raw = await request.body()
        # The router's own time starts with the body's last byte: until then it waits on the client.
        started = time.perf_counter()
        if request.method in ("GET", "DELETE"):
            return raw, {}, started
        body = request_json(raw)
        return body if isinstance(body, Response) else (raw, body, started)

    def _candidates(self, model: str | None) -> list[Replica] | Response:
        """The replicas that may take a request for ``model`` (None: any), or the error."""
        serving = [r for r in self.replicas.replicas.values()
                   if model is None or serves(r, self.heartbeats.get(r.replica_id), model)]
        if model is not None and not serving:
            return openai_error(
                404, f"The model `{model}` does not exist.", "NotFoundError", "model_not_found")
        candidates = [r for r in serving if self.heartbeats.routable(r)]
        if not candidates:
            # Heartbeats alone never fail a request: fall back to what health checks say.
            candidates = [r for r in serving if r.healthy]
        if not candidates:
            self.metrics.requests.labels("none", self.config.policy, "503").inc()
            return openai_error(
                503, "no healthy replica serves this model right now", "service_unavailable")
        return candidates

    async def route(self, request: Request, endpoint: str) -> Response:
        """POST /v1/completions, /v1/chat/completions and /v1/responses (``endpoint``'s)."""
        read = await self._read(request)
        if isinstance(read, Response):
            return read
        raw, body, started = read
        response = await self._route_read(request, endpoint, raw, body, started)
        if (self.activation is not None and isinstance(response, JSONResponse)
                and response.status_code == 502 and not self._any_available(body.get("model"))):
            # Every replica tried had gone (the last one scaled away to zero as this request
            # arrived): nothing was sent to the client yet, so hold it for the next one.
            log.info("no replica left for a request: holding it for the next one")
            response = await self._route_read(request, endpoint, raw, body, time.perf_counter())
        return response

    async def _route_read(self, request: Request, endpoint: str, raw: bytes, body: dict[str, Any],
                          started: float) -> Response:
        model = body.get("model")
        if (held := await self._hold(request, model)) is not None:
            return held
        candidates = self._candidates(model)
        if isinstance(candidates, Response):
            return candidates

        prompt = PromptBlocks([], 0, self.config.block_size)
        adapter = request_adapter(model, candidates, self.heartbeats.get, self.hasher.tokenizers)
        if routing.uses_prefix(self.config.policy):
            prompt = await self._prompt_blocks(endpoint, body, model, len(raw), adapter)
        grant = await self.tenancy.admit(request, endpoint, body, prompt.prompt_tokens, len(raw))
        if isinstance(grant, Response):  # over the tenant's limits: 429
            return grant
        turn = await queued_turn(self.queue, request, endpoint, body, prompt.prompt_tokens, len(raw),
                                 lambda: room_on(candidates, self.heartbeats, self.in_flight), grant,
                                 lambda: running_on(candidates, self.heartbeats))
        if isinstance(turn, Response):  # waited --max-queue-wait (503), or its client left (499)
            return turn
        with turn:  # an exception before the forward ends the turn (fair_queue.Turn)
            header = self.config.session_header
            session = request.headers.get(header) if header else None
            decision, predicted_tokens = self.decided(candidates, prompt, model, body, session, adapter, started)
            decided = time.perf_counter()
            by_id = {r.replica_id: r for r in candidates}
            return turn.ended(await self.forwarder.forward(Routed(
                endpoint=endpoint, body=grant.body or raw,
                headers=replica_headers(request.headers, self.config.replica_api_key, grant.tenant),
                ranked=[by_id[rid] for rid in decision.ranked][: max(1, self.config.max_attempts)],
                hashes=prompt.hashes,
                prompt_tokens=prompt.prompt_tokens,
                predicted_hit_tokens=predicted_tokens,
                session=session,
                router_ms=(decided - started) * 1000,
                predicted_ttft_s=decision.predicted_ttft_s,
                uncalibrated_ttft_s=decision.uncalibrated_ttft_s,
                calibrates=body.get("stream") is True and decision.rate_measured,
                client_left=disconnect_of(request.receive),
                reply_headers=grant.headers,
                on_done=turn.settling(grant.on_done),
                on_open=turn.sent,
            )))

    def decided(self, candidates: list[Replica], prompt: PromptBlocks, model: str | None, body: dict[str, Any],
                session: str | None, adapter: Adapter | None, started: float) -> tuple[routing.Decision, int]:
        """The ranking of ``candidates`` for a generation request (the Decider's, on its prompt's
        blocks, or its text where it has none), counted in the metrics; and its predicted hit
        tokens. The HTTP port and the endpoint picker decide alike."""
        hash_key: int | str = prompt.hashes[0] if prompt.hashes else (
            f"{model}|{str(body.get('prompt', body.get('messages', body.get('input'))))[:256]}")
        decision = self.decider.decide(candidates, prompt.hashes, hash_key, session, prompt.prompt_tokens,
                                       prompt.block_size, adapter.name if adapter else None)
        hit_tokens = decision.matched_blocks * prompt.block_size
        self.metrics.predicted_hit_tokens.inc(hit_tokens)
        self.metrics.predicted_hit_tokens_per_request.observe(hit_tokens)
        self.metrics.prompt_tokens.inc(prompt.prompt_tokens)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        return decision, hit_tokens

    async def _prompt_blocks(self, endpoint: str, body: dict[str, Any], model: str | None,
                             body_bytes: int, adapter: Adapter | None = None) -> PromptBlocks:
        """The prompt's blocks; an adapter's tokenized with its base's tokenizer, hashed with its name."""
        lora = adapter.name if adapter is not None else None
        model = adapter.base if adapter is not None else model
        if endpoint != "responses":
            return await self.hasher.prompt_block_hashes_off_loop(endpoint, body, model, body_bytes, lora)
        # The chat prompt the replica will build: the stored conversation, then this turn.
        store = responses.store_model(model, [self.hasher.names_of(m) for m in self.config.models])
        chat = await responses.chat_prompt(self.conversations, body, store, body_bytes)
        if chat is None:
            self.metrics.fallbacks.labels("untokenizable").inc()
            return PromptBlocks([], 0, self.hasher.block_size(model or ""))
        return await self.hasher.prompt_block_hashes_off_loop("chat", chat.body, model, chat.source_bytes, lora)

    async def stored_response(self, request: Request) -> Response:
        """GET and DELETE /v1/responses/{id}: forwarded to a ready replica of the model whose
        store holds the id (shared), not answered from Redis here: the replica's answer is the one
        implementation of the stored response's JSON, its errors and the query fields it refuses."""
        model = None
        if self.conversations is not None and len(self.config.models) > 1:
            model = await self.conversations.holder(
                [self.hasher.names_of(m)[0] for m in self.config.models], request.path_params["response_id"])
        endpoint = "responses_delete" if request.method == "DELETE" else "responses_get"
        return await self.pass_through(request, endpoint, responses.replica_path(request.scope), model)

    async def pass_through(self, request: Request, endpoint: str, path: str | None = None,
                           model: str | None = None) -> Response:
        """/tokenize, /detokenize, /version, stored responses: a replica's own answer (one URL with
        or without a router), the model's least busy replica first; ``path``: when not the endpoint's."""
        read = await self._read(request)
        if isinstance(read, Response):
            return read
        raw, body, started = read
        model = model or body.get("model")
        if (held := await self._hold(request, model)) is not None:
            return held
        candidates = self._candidates(model)
        if isinstance(candidates, Response):
            return candidates
        ranked = sorted(candidates, key=lambda r: r.in_flight)
        return await self.forwarder.forward(Routed(
            endpoint=endpoint, body=raw, path=path,
            headers=replica_headers(request.headers, self.config.replica_api_key,
                                    tenant.name if (tenant := self.tenancy.tenant_of(request)) else None),
            ranked=ranked[: max(1, self.config.max_attempts)],
            hashes=[], prompt_tokens=0, predicted_hit_tokens=0, session=None,
            router_ms=(time.perf_counter() - started) * 1000,
            client_left=disconnect_of(request.receive),
        ))


def build_app(config: RouterConfig) -> Starlette:
    router = Router(config)

    async def completions(request: Request) -> Response:
        return await router.route(request, "completions")

    async def chat(request: Request) -> Response:
        return await router.route(request, "chat")

    async def create_response(request: Request) -> Response:
        return await router.route(request, "responses")

    async def tokenize(request: Request) -> Response:
        return await router.pass_through(request, "tokenize")

    async def detokenize(request: Request) -> Response:
        return await router.pass_through(request, "detokenize")

    async def version(request: Request) -> Response:
        return await router.pass_through(request, "version")

    async def models(request: Request) -> Response:
        return await status.models(router, request)

    async def health(request: Request) -> Response:
        return await status.health(router, request)

    async def metrics(request: Request) -> Response:
        return await status.metrics(router, request)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", router.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/version", version, methods=["GET"]),
            *update_routes(router),  # --allow-runtime-lora-updating
            Route("/health", health, methods=["GET"]),
            Route("/ping", status.ping, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan, exception_handlers={404: not_found},
        # A draining router turns new requests away (503) while the streams it proxies finish.
        middleware=[Middleware(DrainMiddleware, drain=router.drain, guarded=is_api_request)],
    )
    app.state.router = router
    app.state.drain = router.drain
    return app
