"""Stored responses in the Redis the replicas share (``--responses-store redis``): any replica
of the model answers ``previous_response_id``, ``GET`` and ``DELETE`` for a response another one
stored. The keys, bounds and scripts are kvscale.responses_store_schema's (docs/server.md "The
Responses API")."""

from __future__ import annotations

import logging
from typing import Any

from kvscale import responses_store_schema as schema
from kvscale.kv_index_schema import redacted_url
from kvscale.server.entrypoints.responses_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    DEFAULT_TTL_S,
    StoredResponse,
    StoreUnavailable,
)

logger = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # a request waits at most this long for the store before its 503


class RedisResponseStore:
    """The fleet's store of one model's responses: bounded by entry count and total bytes (least
    recently used evicted first) and by a time to live, each enforced by one atomic script."""

    def __init__(self, url: str, model: str, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float = DEFAULT_TTL_S) -> None:
        import redis.asyncio as aioredis

        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("a response store needs room for one entry, one byte and a positive TTL")
        self.url = redacted_url(url)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.client: Any = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self.prefix, *self.keys = schema.keys(model)
        self._put = self.client.register_script(schema.PUT_SCRIPT)
        self._get = self.client.register_script(schema.GET_SCRIPT)
        self._delete = self.client.register_script(schema.DELETE_SCRIPT)

    async def _run(self, script: Any, *args: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await script(keys=self.keys, args=[self.prefix, *args])
        except (RedisError, OSError) as exc:
            logger.warning("the response store at %s did not answer: %s", self.url, exc)
            raise StoreUnavailable(f"The response store did not answer: {type(exc).__name__}.") from exc

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        data = record.to_bytes()
        return bool(await self._run(self._put, response_id, data, self.ttl_s, self.max_entries, self.max_bytes))

    async def get(self, response_id: str) -> StoredResponse | None:
        data = await self._run(self._get, response_id)
        return StoredResponse.from_bytes(data) if data is not None else None

    async def delete(self, response_id: str) -> bool:
        return bool(await self._run(self._delete, response_id))

    async def close(self) -> None:
        await self.client.aclose()
