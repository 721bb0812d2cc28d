"""Adapters loaded at run time through the router, loaded again onto every replica that lacks
them: one that joins later (scale-out, scale from zero) or comes back (a restarted pod) gets what
the fleet was given (docs/router.md, "Loading adapters at run time").

The record (adapter name -> path) is the router's, and with ``--redis`` the fleet's
(``kvscale.kv_index_schema.RUNTIME_ADAPTERS_KEY``): a second router, or this one restarted, knows
it too. After every health pass each routable replica is compared with it (its heartbeat's
adapters, else its /v1/models'); one that lacks an adapter has its /v1/models read again (a
heartbeat lags a load by up to its interval) and is sent each load it still lacks, unless the record
(read again) no longer holds it. A refused load after which its /v1/models lists the adapter
(another router's load got there first) is done; any other is logged once per replica, adapter and
answer, counted (``kvscale_router_lora_replays_total``) and sent again after the next pass. Until
a replica has the adapter, requests naming it go to the replicas that have it
(``lora_routing.serves``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import Counter

from kvscale import metric_names as names
from kvscale.kv_index_schema import (
    MAX_ADAPTER_NAME_CHARS,
    MAX_ADAPTER_PATH_CHARS,
    MAX_RUNTIME_ADAPTERS,
    RUNTIME_ADAPTERS_KEY,
    record_load_script,
    redacted_url,
    runtime_adapters,
)
from kvscale.metric_registry import register
from kvscale.router.lora_routing import adapters_of
from kvscale.router.replicas import Replica, read_models

if TYPE_CHECKING:
    from kvscale.router.app import Router

log = logging.getLogger("kvscale.router.lora")

MODELS_TIMEOUT_S = 5.0  # a replica's /v1/models, read before loading onto it
# A load reads the adapter's files on the replica: seconds for a large one, never a generation's wait.
LOAD_READ_TIMEOUT_S = 300.0


def field_refusal(body: Mapping[str, Any], field: str, most_chars: int) -> str | None:
    """Why ``body[field]`` cannot be passed on and recorded (the server's bounds on a load), or
    None: a string of 1 to ``most_chars`` characters."""
    value = body.get(field)
    if not isinstance(value, str) or not 0 < len(value) <= most_chars:
        return f"`{field}` must be a string of 1 to {most_chars} characters"
    return None


def update_refusal(update: str, body: Mapping[str, Any], recorded: Collection[str]) -> tuple[str, str] | None:
    """(why, param) a load or unload through the router is refused before any replica sees it, or
    None. A load of a new name into a full record too: the record's size is the client's choice."""
    fields = [("lora_name", MAX_ADAPTER_NAME_CHARS)]
    if update == "load_lora_adapter":
        fields.append(("lora_path", MAX_ADAPTER_PATH_CHARS))
    for field, most in fields:
        if (why := field_refusal(body, field, most)) is not None:
            return why, field
    if update == "load_lora_adapter" and body["lora_name"] not in recorded and len(recorded) >= MAX_RUNTIME_ADAPTERS:
        return (f"at most {MAX_RUNTIME_ADAPTERS} adapters are loaded at run time through the router; "
                "unload one first"), "lora_name"
    return None


def missing_loads(record: Mapping[str, str], held: Mapping[str, Collection[str]]) -> dict[str, list[str]]:
    """Replica id -> the recorded adapters it lacks (by name), for each replica in ``held`` (its
    adapters now) lacking any."""
    missing = {}
    for replica_id, adapters in held.items():
        if lacking := sorted(set(record) - set(adapters)):
            missing[replica_id] = lacking
    return missing


def note_loaded(replica: Replica, name: str) -> None:
    """``replica`` answered a load of ``name``: it serves it (its /v1/models card's parent is its
    first served name), as its heartbeat, where it has one, says within a beat."""
    bases = sorted(replica.models - replica.adapters.keys())
    replica.models.add(name)
    replica.adapters[name] = bases[0] if bases else ""


def note_unloaded(replica: Replica, name: str) -> None:
    replica.models.discard(name)
    replica.adapters.pop(name, None)


class RuntimeAdapters:
    """The record: in this router's memory, and with ``--redis`` in the fleet's Redis, read again
    at every pass (the copy here is the last read plus this router's own updates)."""

    def __init__(self, redis_url: str | None, timeout_s: float, on_redis_error: Any) -> None:
        self.adapters: dict[str, str] = {}
        self.redis_url = redis_url
        self._on_redis_error = on_redis_error
        self._client: Any = None
        self._record_load: Any = None
        self._logged_down = False
        if redis_url:
            import redis.asyncio as aioredis

            # Off the request path and up to a megabyte (the bounds): more than a request's wait.
            self._client = aioredis.Redis.from_url(
                redis_url, socket_timeout=timeout_s * 20, socket_connect_timeout=timeout_s * 20)
            self._record_load = record_load_script(self._client)

    def _redis_failed(self, what: str, exc: Exception) -> None:
        self._on_redis_error()
        if not self._logged_down:
            log.warning("cannot %s the runtime LoRA adapters in redis %s: %s", what,
                        redacted_url(self.redis_url or ""), exc)
        self._logged_down = True

    async def refresh(self) -> None:
        """Read the fleet's record; when Redis fails, keep the copy here."""
        if self._client is None:
            return
        try:
            self.adapters = runtime_adapters(await self._client.hgetall(RUNTIME_ADAPTERS_KEY))
            self._logged_down = False
        except Exception as exc:  # redis down or slow: the last read holds
            self._redis_failed("read", exc)

    async def path_of(self, name: str) -> str | None:
        """Where ``name`` loads from, as the record says now (read again from Redis: another router
        may have unloaded it since this pass began), or None once unloaded."""
        if self._client is not None:
            try:
                path = await self._client.hget(RUNTIME_ADAPTERS_KEY, name)
                return runtime_adapters({name: path}).get(name) if path is not None else None
            except Exception as exc:  # the copy here decides
                self._redis_failed("read", exc)
        return self.adapters.get(name)

    async def loaded(self, name: str, path: str) -> None:
        self.adapters[name] = path
        if self._client is not None:
            try:
                if not await self._record_load(keys=[RUNTIME_ADAPTERS_KEY], args=[name, path, MAX_RUNTIME_ADAPTERS]):
                    log.warning("the runtime LoRA record in redis is full: %s is not kept for replicas "
                                "that join later", name)
                    self.adapters.pop(name)
            except Exception as exc:
                self._redis_failed("record a load of", exc)

    async def unloaded(self, name: str) -> None:
        self.adapters.pop(name, None)
        if self._client is not None:
            try:
                await self._client.hdel(RUNTIME_ADAPTERS_KEY, name)
            except Exception as exc:
                self._redis_failed("record an unload of", exc)

    async def close(self) -> None:
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.aclose(), 2.0)
            except Exception:
                pass


class AdapterReplay:
    """Follows the router's health checks (``ReplicaSet.followers``): one pass at a time, each
    starting the loads of the recorded adapters onto the routable replicas that lack them, one
    task per replica (a replica that joins is not kept waiting by a slow load elsewhere)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        config = router.config
        self.record = RuntimeAdapters(config.redis_url, config.redis_timeout_ms / 1000.0,
                                      router.metrics.redis_errors.inc)
        self.replays: Counter = register(names.ROUTER_LORA_REPLAYS, router.metrics.registry)
        for result in names.ROUTER_LORA_REPLAY_RESULTS:
            self.replays.labels(result)
        self._task: asyncio.Task[None] | None = None
        self._loading: dict[str, asyncio.Task[None]] = {}  # replica url -> its loads under way
        # (replica url, adapter) -> the last failure logged, so a retry every pass logs once.
        self._failing: dict[tuple[str, str], str] = {}

    def checked(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.replay_pass(), name="lora-replay")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._loading.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.record.close()

    def _headers(self) -> dict[str, str]:
        key = self.router.config.replica_api_key
        return {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}

    async def replay_pass(self) -> None:
        try:
            await self.record.refresh()
            if not self.record.adapters:
                return
            routable = {r.replica_id: r for r in self.router.replicas.replicas.values()
                        if self.router.heartbeats.routable(r)}
            held = {rid: adapters_of(r, self.router.heartbeats.get(rid)) for rid, r in routable.items()}
            plan = missing_loads(self.record.adapters, held)
            self._failing = {k: v for k, v in self._failing.items()
                             if k[1] in self.record.adapters and k[0] in {r.url for r in routable.values()}}
            self._loading = {url: t for url, t in self._loading.items() if not t.done()}
            for rid, lacking in plan.items():
                url = routable[rid].url
                if url not in self._loading:
                    self._loading[url] = asyncio.create_task(self._replay_to(routable[rid], lacking),
                                                             name=f"lora-replay {url}")
        except Exception:  # never the health loop's end: the next pass tries again
            log.exception("replaying runtime LoRA adapters failed")

    async def _replay_to(self, replica: Replica, lacking: list[str]) -> None:
        timeout = httpx.Timeout(connect=self.router.config.connect_timeout_s, read=LOAD_READ_TIMEOUT_S,
                                write=30.0, pool=30.0)
        try:
            async with httpx.AsyncClient(timeout=timeout, headers=self._headers()) as client:
                await self._load_lacking(client, replica, lacking)
        except Exception:  # the next pass tries again
            log.exception("replaying runtime LoRA adapters onto %s failed", replica.url)

    async def _load_lacking(self, client: httpx.AsyncClient, replica: Replica, lacking: list[str]) -> None:
        if (why := await self._read_models(client, replica)) is not None:
            for name in lacking:
                self._failed(replica, name, why)
            return
        for name in lacking:  # one at a time: a replica runs its updates one at a time anyway
            path = await self.record.path_of(name)
            if path is None or name in replica.models:
                continue  # unloaded meanwhile, or the heartbeat lagged its load
            try:
                loaded = await client.post(f"{replica.url}/v1/load_lora_adapter",
                                           json={"lora_name": name, "lora_path": path})
            except httpx.HTTPError as exc:
                self._failed(replica, name, f"cannot reach it: {type(exc).__name__} {exc}")
                continue
            if not 200 <= loaded.status_code < 300:
                if await self._serves_now(client, replica, name):
                    continue  # another router's replay got there first (the replica's 400)
                self._failed(replica, name, f"it answered {loaded.status_code}: {loaded.text[:300]}")
                continue
            note_loaded(replica, name)
            self._failing.pop((replica.url, name), None)
            self.replays.labels("loaded").inc()
            log.info("loaded LoRA adapter %s (%s) onto replica %s, which lacked it", name, path, replica.url)

    async def _read_models(self, client: httpx.AsyncClient, replica: Replica) -> str | None:
        """Read what ``replica`` serves from its /v1/models; None, or why it could not be read."""
        try:
            answer = await client.get(f"{replica.url}/v1/models", timeout=MODELS_TIMEOUT_S)
            answer.raise_for_status()
            read_models(replica, answer.json().get("data", []))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"its /v1/models could not be read: {type(exc).__name__} {exc}"
        return None

    async def _serves_now(self, client: httpx.AsyncClient, replica: Replica, name: str) -> bool:
        """The replica's /v1/models, read again, lists ``name``."""
        return await self._read_models(client, replica) is None and name in replica.models

    def _failed(self, replica: Replica, name: str, why: str) -> None:
        self.replays.labels("failed").inc()
        if self._failing.get((replica.url, name)) != why:
            log.warning("cannot load LoRA adapter %s onto replica %s, which lacks it: %s; trying again "
                        "after the next health check", name, replica.url, why)
        self._failing[(replica.url, name)] = why
