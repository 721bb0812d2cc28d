"""The router's ASGI app: the parts wired together, their lifecycle, and the HTTP endpoints.

Per request: parse the body, hash the prompt's full blocks (``prefix_hashes``), rank the
replicas (``decision``, ``policy``), then forward down the ranking (``proxy``). Heartbeats from
Redis (``redis_feed``, ``heartbeats``) and health checks (``replicas``) say who is routable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvscale.drain import Drain, DrainMiddleware
from kvscale.processes import freeze_startup_heap
from kvscale.router import activation as holding
from kvscale.router import policy as routing
from kvscale.router.admission import is_api_request
from kvscale.router.auth import check_api_key
from kvscale.router.client_watch import disconnect_of
from kvscale.router.config import RouterConfig
from kvscale.router.decision import Decider
from kvscale.router.errors import openai_error
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.hold_gate import activation_report, hold_until_ready, refusal, worth_holding
from kvscale.router.in_flight import InFlight
from kvscale.router.index import PrefixIndex
from kvscale.router.metrics import RouterMetrics
from kvscale.router.prefix_hashes import PrefixHasher, PromptBlocks
from kvscale.router.proxy import Forwarder, Routed, replica_headers
from kvscale.router.replicas import EndpointSliceWatch, Replica, ReplicaSet

log = logging.getLogger("kvscale.router")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        if config.policy not in routing.POLICIES:
            choices = ", ".join(routing.POLICIES)
            raise ValueError(f"unknown routing policy {config.policy!r}; choose one of {choices}")
        self.config = config
        self.metrics = RouterMetrics(config.policy)
        in_process = config.redis_url is None
        # Without Redis the index is only the router's own decisions; keep them until capacity.
        self.index = PrefixIndex(prediction_ttl_s=(1e9 if in_process else 10.0))
        # A replica discovery drops (its pod NotReady or deleted) leaves the index, the ledgers, the
        # heartbeat table and the metrics' series at once.
        self.replicas = ReplicaSet(
            api_key=config.replica_api_key, health_interval_s=config.health_interval_s,
            on_removed=lambda replica: self.decider.forget(replica.replica_id),
            on_renamed=lambda old, new: self.decider.renamed(old, new),
        )
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
        if config.hold_timeout_s is not None:
            wake = None
            if config.scale_from_zero:
                from kvscale.router.wake import ScaleFromZero

                wake = ScaleFromZero(config.scale_from_zero, config.namespace, self.metrics)
            self.activation = holding.Activation(
                holding.HoldLimits(config.hold_timeout_s, config.hold_queue), self.metrics, wake)
            self.forwarder.draining_is_failure = True
        self._watch: EndpointSliceWatch | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self.drain = Drain()  # flipped by SIGTERM (kvscale.drain.serve)
        self._started = time.monotonic()

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

    async def _sync_loop(self) -> None:
        while True:
            self.sync_heartbeats()
            await asyncio.sleep(0.25)

    def sync_heartbeats(self) -> None:
        """Fold heartbeats into the replica table and refresh the gauges."""
        self.heartbeats.fold_into(self.replicas, self.hasher.block_sizes)
        feed = self.heartbeats.feed
        self.metrics.redis_up.set(1 if (feed is not None and feed.healthy) else 0)
        self.metrics.replicas_healthy.set(
            sum(1 for r in self.replicas.replicas.values() if self.heartbeats.routable(r)))
        self.metrics.set_index_blocks(self.index.sizes())
        if self.activation is not None:
            self.activation.update(self._any_available())

    def _any_available(self, model: str | None = None) -> bool:
        """A replica can take a request for ``model`` (None: any) now: what `_candidates` accepts."""
        # A replica's models are known once its first health check passed: before that
        # `_candidates` would answer 404 for it.
        return any(r.models and (model is None or model in r.models)
                   and (r.healthy or self.heartbeats.routable(r))
                   for r in self.replicas.replicas.values())

    async def _hold(self, request: Request, model: str | None) -> Response | None:
        if self.activation is None:
            return None
        return await hold_until_ready(self.activation, request, model, self._any_available,
                                      worth_holding=worth_holding(model, self.config.served_model_names),
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
        if (denied := check_api_key(request, self.config.api_key)) is not None:
            return denied
        raw = await request.body()
        # The router's own time starts with the body's last byte: until then it waits on the client.
        started = time.perf_counter()
        if request.method == "GET":
            return raw, {}, started
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as exc:
            return openai_error(400, f"invalid JSON body: {exc}", "invalid_request_error")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return openai_error(400, "model must be a string", "invalid_request_error")
        return raw, body, started

    def _candidates(self, model: str | None) -> list[Replica] | Response:
        """The replicas that may take a request for ``model`` (None: any), or the error."""
        serving = [r for r in self.replicas.replicas.values() if model is None or model in r.models]
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
        """POST /v1/completions ("completions") and /v1/chat/completions ("chat")."""
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
        if routing.uses_prefix(self.config.policy):
            prompt = await self.hasher.prompt_block_hashes_off_loop(endpoint, body, model, len(raw))
        header = self.config.session_header
        session = request.headers.get(header) if header else None
        hash_key: int | str = (
            prompt.hashes[0] if prompt.hashes
            else f"{model}|{str(body.get('prompt', body.get('messages')))[:256]}"
        )
        decision = self.decider.decide(
            candidates, prompt.hashes, hash_key, session, prompt.prompt_tokens, prompt.block_size)
        predicted_tokens = decision.matched_blocks * prompt.block_size
        self.metrics.predicted_hit_tokens.inc(predicted_tokens)
        self.metrics.predicted_hit_tokens_per_request.observe(predicted_tokens)
        self.metrics.prompt_tokens.inc(prompt.prompt_tokens)
        decided = time.perf_counter()
        self.metrics.decision_seconds.observe(decided - started)

        by_id = {r.replica_id: r for r in candidates}
        return await self.forwarder.forward(Routed(
            endpoint=endpoint,
            body=raw,
            headers=replica_headers(request.headers, self.config.replica_api_key),
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
        ))

    async def pass_through(self, request: Request, endpoint: str) -> Response:
        """/tokenize, /detokenize and /version: a replica's own answer, so that a client keeps
        one URL with or without a router. No cache is involved: the least busy replica of the
        model answers, the others stand by for failover."""
        read = await self._read(request)
        if isinstance(read, Response):
            return read
        raw, body, started = read
        if (held := await self._hold(request, body.get("model"))) is not None:
            return held
        candidates = self._candidates(body.get("model"))
        if isinstance(candidates, Response):
            return candidates
        ranked = sorted(candidates, key=lambda r: r.in_flight)
        return await self.forwarder.forward(Routed(
            endpoint=endpoint,
            body=raw,
            headers=replica_headers(request.headers, self.config.replica_api_key),
            ranked=ranked[: max(1, self.config.max_attempts)],
            hashes=[],
            prompt_tokens=0,
            predicted_hit_tokens=0,
            session=None,
            router_ms=(time.perf_counter() - started) * 1000,
            client_left=disconnect_of(request.receive),
        ))

    async def models(self, request: Request) -> Response:
        if (denied := check_api_key(request, self.config.api_key)) is not None:
            return denied
        names = sorted({m for r in self.replicas.replicas.values() if self.heartbeats.routable(r)
                        for m in r.models})
        if not names and self.activation is not None:
            # At zero replicas the model is still served: a request for it wakes a replica.
            names = sorted(self.config.served_model_names)
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "kvscale"} for n in names]})

    async def health(self, request: Request) -> Response:
        if self.drain.draining:
            return JSONResponse(
                {"status": "draining", "policy": self.config.policy}, status_code=503)
        indexed = self.index.sizes()
        # index_blocks: what the operator's pod-deletion-cost weighs (the warm cache routed to).
        replicas = [
            {"url": r.url, "id": r.replica_id, "healthy": self.heartbeats.routable(r),
             "in_flight": r.in_flight, "models": sorted(r.models),
             "status": self.heartbeats.replica_status(r),
             "index_blocks": indexed.get(r.replica_id, 0)}
            for r in self.replicas.replicas.values()
        ]
        # Holding requests at zero replicas is serving: the router stays ready (its Service
        # keeps it) so that requests reach it and wake the servers.
        ok = any(r["healthy"] for r in replicas) or self.activation is not None
        feed = self.heartbeats.feed
        redis_state = None if feed is None else ("up" if feed.healthy else "down")
        tokenizers = [{"model": name, "loaded": error is None, **({"error": error} if error else {})}
                      for name, error in self.hasher.tokenizer_status().items()]
        return JSONResponse(
            {"status": "ok" if ok else "no healthy replica", "policy": self.config.policy,
             "redis": redis_state, "tokenizers": tokenizers, "replicas": replicas,
             "activation": self.activation_report()},
            status_code=200 if ok else 503,
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        self.sync_heartbeats()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def ping(request: Request) -> Response:
    """Liveness: answered by the event loop itself, so a wedged loop fails it (a TCP probe is
    answered by the kernel, and /health is rightly 503 while no server is ready)."""
    return Response(status_code=200)


def build_app(config: RouterConfig) -> Starlette:
    router = Router(config)

    async def completions(request: Request) -> Response:
        return await router.route(request, "completions")

    async def chat(request: Request) -> Response:
        return await router.route(request, "chat")

    async def tokenize(request: Request) -> Response:
        return await router.pass_through(request, "tokenize")

    async def detokenize(request: Request) -> Response:
        return await router.pass_through(request, "detokenize")

    async def version(request: Request) -> Response:
        return await router.pass_through(request, "version")

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
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/version", version, methods=["GET"]),
            Route("/health", router.health, methods=["GET"]),
            Route("/ping", ping, methods=["GET"]),
            Route("/metrics", router.metrics_endpoint, methods=["GET"]),
        ],
        lifespan=lifespan,
        # A draining router turns new requests away (503) while the streams it proxies finish.
        middleware=[Middleware(DrainMiddleware, drain=router.drain, guarded=is_api_request)],
    )
    app.state.router = router
    app.state.drain = router.drain
    return app
