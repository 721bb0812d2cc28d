"""The router's ASGI app: OpenAI endpoints proxied to the replica the policy picks.

Per request: parse the body, tokenize the prompt the way the server does, hash its full blocks
with the engine's block-hash module, ask the index which replicas hold the leading blocks, let
the policy rank replicas, then proxy. Connection errors, timeouts and 5xx before the first body
byte move on to the next replica in the ranking; once a byte went to the client the response
is committed and streamed through chunk by chunk, never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvscale.block_hash import hash_prompt_blocks
from kvscale.drain import DRAINING_HEADER, Drain, DrainMiddleware
from kvscale.processes import freeze_startup_heap
from kvscale.router import policy as routing
from kvscale.router.chat_tokens import DEFAULT_MAX_TOKENS, ChatTokenCache
from kvscale.router.index import PrefixIndex
from kvscale.router.load import PrefillLedger, ttft_inputs
from kvscale.router.metrics import RouterMetrics, is_spill
from kvscale.router.replicas import (
    EndpointSliceWatch,
    Replica,
    ReplicaSet,
    describe_check,
    normalize_url,
)

log = logging.getLogger("kvscale.router")

# Response headers that describe one hop, not the body.
# A replica whose heartbeat has been missing this long (while Redis answers) is skipped.
HEARTBEAT_STALE_S = 3.0
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list)
    k8s_service: str | None = None
    k8s_namespace_wide: bool = False  # every InferenceService's servers in `namespace`
    namespace: str = "default"
    k8s_port_name: str | None = None
    policy: str = routing.DEFAULT_POLICY
    redis_url: str | None = None
    redis_timeout_ms: float = 50.0
    api_key: str | None = None
    replica_api_key: str | None = None
    block_size: int = 16
    models: list[str | None] = field(default_factory=lambda: [None])  # tokenizers to load
    session_header: str | None = "x-session-id"
    epsilon: float = 0.25
    ttft_epsilon: float | None = routing.TTFT_EPSILON  # predicted-ttft's load cap; None: off
    max_attempts: int = 3
    health_interval_s: float = 2.0
    connect_timeout_s: float = 2.0
    seed: int | None = None
    freeze_heap_after_start: bool = False  # the CLI sets it; tests that build many apps do not
    chat_cache_tokens: int = DEFAULT_MAX_TOKENS  # chat prompts' token ids kept across turns; 0: off


def openai_error(status: int, message: str, err_type: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": None, "code": code}}, status_code=status
    )


class Router:
    def __init__(self, config: RouterConfig) -> None:
        if config.policy not in routing.POLICIES:
            raise ValueError(f"unknown routing policy {config.policy!r}; choose one of {', '.join(routing.POLICIES)}")
        self.config = config
        self.metrics = RouterMetrics(config.policy)
        in_process = config.redis_url is None
        # Without Redis the index is only the router's own decisions; keep them until capacity.
        self.index = PrefixIndex(prediction_ttl_s=(1e9 if in_process else 10.0))
        # A replica discovery drops (its pod NotReady or deleted) leaves the index at once.
        self.replicas = ReplicaSet(
            api_key=config.replica_api_key, health_interval_s=config.health_interval_s,
            on_removed=lambda replica: self.index.forget(replica.replica_id),
        )
        self.replicas.set_urls(config.replicas)
        self.feed = None
        self.tokenizers: dict[str, Any] = {}
        self.chat_caches: dict[str, ChatTokenCache] = {}  # model -> its conversations' cached prefixes
        self.block_sizes: dict[str, int] = {}  # model -> block size, from heartbeats
        self._client: httpx.AsyncClient | None = None
        self._counter = 0
        self._rng = random.Random(config.seed)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._seen_heartbeat: dict[str, float] = {}  # replica id -> when last seen
        self._index_gauge_ids: set[str] = set()
        self._ledgers: dict[str, PrefillLedger] = {}  # replica id -> our requests there (TTFT policy)
        self._tickets = 0
        self._watch: EndpointSliceWatch | None = None
        self._sync_task: asyncio.Task | None = None
        self.drain = Drain()  # flipped by SIGTERM (kvscale.drain.serve)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load_tokenizers)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=30)
        timeout = httpx.Timeout(connect=self.config.connect_timeout_s, read=600.0, write=30.0, pool=30.0)
        self._client = httpx.AsyncClient(limits=limits, timeout=timeout)
        if self.config.redis_url:
            from kvscale.router.redis_feed import RedisFeed

            self.feed = RedisFeed(
                self.config.redis_url,
                self.index,
                timeout_s=self.config.redis_timeout_ms / 1000.0,
                on_error=self.metrics.redis_errors.inc,
            )
            await self.feed.start()
        else:
            log.warning("no --redis: the prefix index lives in this router process only, built from its own decisions")
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
            # Tokenizers pull in transformers and torch: without this a full GC stalls routing ~200 ms.
            freeze_startup_heap()

    async def stop(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
        if self._watch is not None:
            self._watch.stop()
        await self.replicas.stop()
        if self.feed is not None:
            await self.feed.stop()
        if self._client is not None:
            await self._client.aclose()

    def _load_tokenizers(self) -> None:
        from kvscale.model_files import load_tokenizer, resolve_tokenizer_path, served_model_name

        for model in self.config.models:
            name = served_model_name(model)
            # The tokenizer alone: the bundled model's full conversion needs torch.
            self.tokenizers[name] = load_tokenizer(resolve_tokenizer_path(model))
            self.chat_caches[name] = ChatTokenCache(self.tokenizers[name], self.config.chat_cache_tokens)
            log.info("tokenizer for %s loaded", name)

    async def _sync_loop(self) -> None:
        """Fold heartbeats into the replica table and refresh gauges."""
        while True:
            self.sync_heartbeats()
            await asyncio.sleep(0.25)

    def sync_heartbeats(self) -> None:
        if self.feed is not None and self.feed.healthy:
            beats = self.feed.heartbeats
            self.replicas.bind_heartbeat_ids({hb.base_url: rid for rid, hb in beats.items() if hb.base_url})
            for hb in beats.values():
                if hb.block_size:
                    self.block_sizes[hb.model] = hb.block_size
            now = time.monotonic()
            for replica_id in beats:
                self._seen_heartbeat[replica_id] = now
        self.metrics.redis_up.set(1 if (self.feed is not None and self.feed.healthy) else 0)
        self.metrics.replicas_healthy.set(sum(1 for r in self.replicas.replicas.values() if self.routable(r)))
        sizes = self.index.sizes()
        for replica_id, size in sizes.items():
            self.metrics.index_blocks.labels(replica_id).set(size)
        # A replica the index forgot (dropped by discovery, or gone from Redis) leaves the gauge.
        for replica_id in self._index_gauge_ids - sizes.keys():
            self.metrics.index_blocks.remove(replica_id)
        self._index_gauge_ids = set(sizes)

    # -- decisions ---------------------------------------------------------------------------------
    def routable(self, replica: Replica) -> bool:
        return replica.healthy and not self.heartbeat_stale(replica)

    def heartbeat_stale(self, replica: Replica) -> bool:
        """It used to heartbeat and has not for a while, though Redis has been answering."""
        feed = self.feed
        if feed is None or not feed.healthy or feed.healthy_since is None:
            return False
        last_seen = self._seen_heartbeat.get(replica.replica_id)
        if last_seen is None:
            return False  # never published (no --redis): health checks alone decide
        now = time.monotonic()
        grace = HEARTBEAT_STALE_S
        return now - feed.healthy_since > grace and now - last_seen > grace

    def _load(self, replica: Replica) -> tuple[int, float]:
        hb = self.feed.heartbeats.get(replica.replica_id) if self.feed is not None and self.feed.healthy else None
        if hb is None:
            return replica.in_flight, 0.0
        load = routing.effective_load(replica.in_flight, hb.load, hb.timestamp, replica.last_finished)
        return load, hb.kv_usage

    def _release(self, replica: Replica) -> None:
        replica.in_flight -= 1
        replica.last_finished = time.time()
        self.metrics.in_flight.labels(replica.replica_id).set(replica.in_flight)

    def prompt_block_hashes(self, endpoint: str, body: dict, model: str | None) -> tuple[list[int], int, int]:
        """(block hashes, prompt tokens, block size); empty when the prompt can't be tokenized here."""
        name = model if model else next(iter(self.tokenizers), "")
        tokenizer = self.tokenizers.get(name)
        block_size = self.block_sizes.get(model or "", self.config.block_size)
        if tokenizer is None:
            self.metrics.fallbacks.labels("no_tokenizer").inc()
            return [], 0, block_size
        from kvscale.tokenization import completion_prompt_token_ids

        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        try:
            if endpoint == "chat":
                # A follow-up turn tokenizes and hashes only what follows the cached history.
                cache = self.chat_caches.get(name)
                if cache is None:  # a tokenizer set without _load_tokenizers
                    cache = self.chat_caches[name] = ChatTokenCache(tokenizer, self.config.chat_cache_tokens)
                token_ids, hashes = cache.prompt(body["messages"], block_size, salt)
                return hashes, len(token_ids), block_size
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch: route by its first prompt
            token_ids = completion_prompt_token_ids(tokenizer, prompt)
        except Exception:
            # A malformed prompt: the replica will answer with the proper error.
            self.metrics.fallbacks.labels("untokenizable").inc()
            return [], 0, block_size
        hashes = hash_prompt_blocks(token_ids, block_size, cache_salt=salt)
        return hashes, len(token_ids), block_size

    def decide(
        self, candidates: list[Replica], hashes: list[int], hash_key: int | str, session: str | None,
        prompt_tokens: int = 0, block_size: int = 16,
    ) -> routing.Decision:
        by_id = {r.replica_id: r for r in candidates}
        now = time.monotonic()
        matched = (
            self.index.match(hashes, by_id, now) if routing.uses_prefix(self.config.policy) else dict.fromkeys(by_id, 0)
        )
        views = []
        wall = time.time()
        for replica in candidates:
            load, kv_usage = self._load(replica)
            hb = self.feed.heartbeats.get(replica.replica_id) if self.feed is not None and self.feed.healthy else None
            extra = ttft_inputs(hb, self._ledgers.get(replica.replica_id), wall)
            views.append(routing.Candidate(replica.replica_id, load, kv_usage, matched[replica.replica_id], **extra))
        index_stale = self.feed is not None and not self.feed.healthy
        if index_stale:
            self.metrics.fallbacks.labels("redis_down").inc()
        self._counter += 1
        sticky = self._sessions.get(session) if session else None
        decision = routing.decide(
            self.config.policy,
            views,
            prompt_blocks=len(hashes),
            hash_key=hash_key,
            counter=self._counter,
            rng=self._rng,
            epsilon=self.config.epsilon,
            prompt_tokens=prompt_tokens,
            block_size=block_size,
            ttft_epsilon=self.config.ttft_epsilon,
            sticky_replica=sticky,
            index_stale=index_stale,
        )
        if decision.ranked and is_spill(matched, decision.ranked[0], decision.reason):
            self.metrics.spills.inc()
        return decision

    def _remember_session(self, session: str | None, replica_id: str) -> None:
        if not session:
            return
        self._sessions[session] = replica_id
        self._sessions.move_to_end(session)
        while len(self._sessions) > 100_000:
            self._sessions.popitem(last=False)

    # -- HTTP ----------------------------------------------------------------------------------------
    def check_api_key(self, request: Request) -> JSONResponse | None:
        if not self.config.api_key:
            return None
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if hmac.compare_digest(token.encode(), self.config.api_key.encode()):
            return None
        return openai_error(401, "invalid or missing API key", "authentication_error", "invalid_api_key")

    def known_models(self) -> set[str]:
        return {m for r in self.replicas.replicas.values() for m in r.models}

    async def proxy(self, request: Request, endpoint: str) -> Response:
        if (denied := self.check_api_key(request)) is not None:
            return denied
        raw = await request.body()
        # The router's own time starts with the body's last byte: until then it waits on the client.
        started = time.perf_counter()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as exc:
            return openai_error(400, f"invalid JSON body: {exc}", "invalid_request_error")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return openai_error(400, "model must be a string", "invalid_request_error")
        serving = [r for r in self.replicas.replicas.values() if model is None or model in r.models]
        if model is not None and not serving:
            return openai_error(404, f"The model `{model}` does not exist.", "NotFoundError", "model_not_found")
        candidates = [r for r in serving if self.routable(r)]
        if not candidates:
            # Heartbeats alone never fail a request: fall back to what health checks say.
            candidates = [r for r in serving if r.healthy]
        if not candidates:
            self.metrics.requests.labels("none", self.config.policy, "503").inc()
            return openai_error(503, "no healthy replica serves this model right now", "service_unavailable")

        hashes, prompt_tokens, block_size = [], 0, self.config.block_size
        if routing.uses_prefix(self.config.policy):
            hashes, prompt_tokens, block_size = self.prompt_block_hashes(endpoint, body, model)
        session = request.headers.get(self.config.session_header) if self.config.session_header else None
        hash_key: int | str = hashes[0] if hashes else f"{model}|{str(body.get('prompt', body.get('messages')))[:256]}"
        decision = self.decide(candidates, hashes, hash_key, session, prompt_tokens, block_size)
        predicted_tokens = decision.matched_blocks * block_size
        self.metrics.predicted_hit_tokens.inc(predicted_tokens)
        self.metrics.predicted_hit_tokens_per_request.observe(predicted_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        decided = time.perf_counter()
        self.metrics.decision_seconds.observe(decided - started)

        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        headers = {"content-type": "application/json"}
        for name in ("accept", "x-request-id"):
            if name in request.headers:
                headers[name] = request.headers[name]
        if self.config.replica_api_key:
            headers["authorization"] = f"Bearer {self.config.replica_api_key}"
        by_id = {r.replica_id: r for r in candidates}
        ranked = [by_id[rid] for rid in decision.ranked][: max(1, self.config.max_attempts)]
        assert self._client is not None
        last_error = "no replica answered"
        for attempt, replica in enumerate(ranked):
            is_last = attempt == len(ranked) - 1
            if routing.uses_prefix(self.config.policy) and hashes:
                self.index.predict(replica.replica_id, hashes, time.monotonic())
            replica.in_flight += 1
            ticket = self._tickets = self._tickets + 1
            ledger = self._ledgers.setdefault(replica.replica_id, PrefillLedger())
            hit = decision.matched_blocks * block_size if attempt == 0 else 0
            ledger.sent(ticket, max(prompt_tokens - hit, 1), time.time())
            self.metrics.in_flight.labels(replica.replica_id).set(replica.in_flight)
            committed = False
            upstream: httpx.Response | None = None
            try:
                upstream = await self._client.send(
                    self._client.build_request("POST", replica.url + path, content=raw, headers=headers),
                    stream=True,
                )
                if upstream.status_code == 503 and upstream.headers.get(DRAINING_HEADER) and not is_last:
                    last_error = f"replica {replica.replica_id} is draining"
                    self._mark_draining(replica)
                    self.metrics.retries.labels("draining").inc()
                    continue
                if upstream.status_code >= 500 and not is_last:
                    last_error = f"replica {replica.replica_id} answered {upstream.status_code}"
                    self.metrics.retries.labels("status_5xx").inc()
                    continue
                chunks = upstream.aiter_raw()
                try:
                    first = await chunks.__anext__()
                except StopAsyncIteration:
                    first = b""
                if endpoint != "chat":  # a chat stream's first chunk is the role, sent before prefill
                    ledger.started(ticket, time.time())
                committed = True
            except (httpx.TransportError, httpx.StreamError) as exc:
                last_error = f"replica {replica.replica_id}: {type(exc).__name__}: {exc}"
                self.replicas.mark_down(replica)
                self.metrics.retries.labels("timeout" if isinstance(exc, httpx.TimeoutException) else "connection").inc()
                continue
            finally:
                if not committed:
                    ledger.done(ticket, time.time())
                    self._release(replica)
                    if upstream is not None:
                        await upstream.aclose()
            self._remember_session(session, replica.replica_id)
            self.metrics.requests.labels(replica.replica_id, self.config.policy, str(upstream.status_code)).inc()
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
            out_headers["x-kvscale-replica"] = replica.replica_id
            out_headers["x-kvscale-router-ms"] = f"{(decided - started) * 1000:.3f}"
            out_headers["x-kvscale-predicted-hit-tokens"] = str(predicted_tokens)
            return StreamingResponse(
                self._passthrough(first, chunks, upstream, replica, ticket, ledger),
                status_code=upstream.status_code,
                headers=out_headers,
            )
        self.metrics.requests.labels("none", self.config.policy, "502").inc()
        return openai_error(502, f"every replica tried failed: {last_error}", "bad_gateway")

    def _replica_status(self, replica: Replica) -> str:
        """Why a replica is (not) routable, for /health: its health check's verdict, or a stale heartbeat."""
        if replica.status == "ok" and not replica.healthy:
            return "marked down after a failed request; waiting for the next health check"
        if replica.status == "ok" and self.heartbeat_stale(replica):
            return "heartbeat in Redis is stale"
        return replica.status

    def _mark_draining(self, replica: Replica) -> None:
        """Route around a replica that said it is shutting down (its /health answers 503 too, so
        health checks keep it out until it is gone or back)."""
        if replica.healthy:
            log.warning("replica %s is draining (shutting down); routing around it", replica.url)
        replica.healthy = False
        replica.status = describe_check("/health", 503, None, "draining")  # what its next check says

    async def _passthrough(self, first: bytes, chunks, upstream: httpx.Response, replica: Replica, ticket: int,
                           ledger: PrefillLedger):
        # The ledger itself, not a lookup by replica id: the id changes when the replica's first
        # heartbeat binds it (a router that just started), and the lookup then cut the stream.
        try:
            if first:
                yield first
            async for chunk in chunks:
                ledger.started(ticket, time.time())
                yield chunk
        except (httpx.TransportError, httpx.StreamError) as exc:
            # Already streaming: never retried; the client sees the stream end.
            log.warning("replica %s broke a stream mid-way: %s", replica.replica_id, exc)
        finally:
            ledger.done(ticket, time.time())
            self._release(replica)
            await upstream.aclose()

    async def models(self, request: Request) -> Response:
        if (denied := self.check_api_key(request)) is not None:
            return denied
        names = sorted({m for r in self.replicas.replicas.values() if self.routable(r) for m in r.models})
        return JSONResponse(
            {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "kvscale"} for n in names]}
        )

    async def health(self, request: Request) -> Response:
        if self.drain.draining:
            return JSONResponse({"status": "draining", "policy": self.config.policy}, status_code=503)
        replicas = [
            {"url": r.url, "id": r.replica_id, "healthy": self.routable(r), "in_flight": r.in_flight,
             "models": sorted(r.models), "status": self._replica_status(r)}
            for r in self.replicas.replicas.values()
        ]
        ok = any(r["healthy"] for r in replicas)
        redis_state = None if self.feed is None else ("up" if self.feed.healthy else "down")
        return JSONResponse(
            {"status": "ok" if ok else "no healthy replica", "policy": self.config.policy, "redis": redis_state,
             "replicas": replicas},
            status_code=200 if ok else 503,
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        self.sync_heartbeats()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _is_api_request(method: str, path: str) -> bool:
    return method == "POST" and path.startswith("/v1/")


def build_app(config: RouterConfig) -> Starlette:
    router = Router(config)

    async def completions(request: Request) -> Response:
        return await router.proxy(request, "completions")

    async def chat(request: Request) -> Response:
        return await router.proxy(request, "chat")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
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
            Route("/health", router.health, methods=["GET"]),
            Route("/metrics", router.metrics_endpoint, methods=["GET"]),
        ],
        lifespan=lifespan,
        # A draining router turns new requests away (503) while the streams it proxies finish.
        middleware=[Middleware(DrainMiddleware, drain=router.drain, guarded=_is_api_request)],
    )
    app.state.router = router
    app.state.drain = router.drain
    return app


__all__ = ["RouterConfig", "Router", "build_app", "normalize_url"]
