"""``/v1/responses`` through the router: the prompt a replica will build for a Responses request,
so that a conversation's next turn is routed to the replica holding its prefix.

A replica carries a Responses request out as a chat request whose messages are ``instructions``
(a system message), the stored conversation ``previous_response_id`` names, then the request's
input items as chat messages; function tools become chat's tools (kvscale.responses_messages,
the server's own conversion). This module builds the same chat body from the request's JSON and
the stored record, read from the Redis the replicas store
responses in (kvscale.responses_store_schema), and the router hashes it as a chat prompt, so its
block hashes are the replica's. Whatever it cannot read (a malformed item, a record not found,
Redis not answering) leaves the request routed by load: the replica answers with the proper
error, the one implementation of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvscale import responses_store_schema as schema
from kvscale.kv_index_schema import redacted_url
from kvscale.responses_messages import MAX_RESPONSE_ID_CHARS, Unreadable, chat_tools, input_messages

log = logging.getLogger("kvscale.router")

# A larger stored record is not read: the request is routed by load. A conversation as long as
# the largest served context is far smaller.
MAX_RECORD_BYTES = 8 * 1024 * 1024


def chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request's prompt fields (``messages``, ``tools``) a replica builds for the
    Responses request ``body`` after the stored conversation ``history``; raises Unreadable."""
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    chat: dict[str, Any] = {"messages": [*system, *history, *input_messages(body.get("input"))]}
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    return chat


def previous_id(body: dict[str, Any]) -> str | None:
    """The ``previous_response_id`` worth looking up (a longer one is refused by the replica)."""
    value = body.get("previous_response_id")
    # A longer id is refused by the replica: not looked up.
    return value if isinstance(value, str) and 0 < len(value) <= MAX_RESPONSE_ID_CHARS else None


@dataclass(frozen=True)
class ChatPrompt:
    body: dict[str, Any]  # messages and tools, as a chat request's JSON
    source_bytes: int  # the request's and the stored record's: how long hashing it may take


class StoredConversations:
    """Reads stored responses' conversations from the replicas' shared Redis store. Reads only:
    a plain GET of the record, so a read here neither refreshes nor drops anything (the replica
    that answers the request does both)."""

    def __init__(self, url: str, timeout_s: float, on_error: Callable[[], None] = lambda: None) -> None:
        import redis.asyncio as aioredis

        self.url = redacted_url(url)
        self.client: Any = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._on_error = on_error

    async def close(self) -> None:
        await self.client.aclose()

    async def _read(self, key: str) -> bytes | None:
        from redis.exceptions import RedisError

        try:
            # One byte over the bound says the record is larger than it.
            return await self.client.getrange(key, 0, MAX_RECORD_BYTES) or None
        except (RedisError, OSError) as exc:
            self._on_error()
            log.warning("the response store at %s did not answer: %s; routing by load", self.url, exc)
            return None

    async def conversation(self, store_model: str, response_id: str) -> tuple[list[dict[str, Any]], int] | None:
        """The conversation the stored response ``response_id`` ends, and the record's size; None
        when it is not stored (or expired), too large, or Redis does not answer."""
        record = await self._read(schema.record_key(store_model, response_id))
        if record is None or len(record) > MAX_RECORD_BYTES:
            return None
        conversation = schema.record_conversation(record)
        return None if conversation is None else (conversation, len(record))

    async def holder(self, store_models: list[str], response_id: str) -> str | None:
        """Which of ``store_models`` has ``response_id`` stored, if any."""
        from redis.exceptions import RedisError

        if len(response_id) > MAX_RESPONSE_ID_CHARS:
            return None

        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for model in store_models:
                    pipe.exists(schema.record_key(model, response_id))
                found = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._on_error()
            log.warning("the response store at %s did not answer: %s", self.url, exc)
            return None
        return next((model for model, exists in zip(store_models, found, strict=True) if exists), None)


def replica_path(scope: Mapping[str, Any]) -> str:
    """The request's path and query as the client sent them (a response id percent-encoded as it
    came), for the replica."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (path + (b"?" + query if query else b"")).decode("latin-1")


def store_model(request_model: str | None, served: list[list[str]]) -> str | None:
    """The name a model's replicas key its stored responses by (its first served name) for a
    request naming ``request_model`` (None: the first model), given each model's served names."""
    for names in served:
        if names and (request_model is None or request_model in names):
            return names[0]
    return None


async def chat_prompt(conversations: StoredConversations | None, body: dict[str, Any], store_name: str | None,
                      body_bytes: int) -> ChatPrompt | None:
    """The chat prompt a replica will build for the Responses request ``body``; None when this
    router cannot build it (no store to read the previous response from, or a request it cannot
    read)."""
    history: list[dict[str, Any]] = []
    source_bytes = body_bytes
    if (response_id := previous_id(body)) is not None:
        if conversations is None or store_name is None:
            return None
        stored = await conversations.conversation(store_name, response_id)
        if stored is None:
            return None
        history, record_bytes = stored
        source_bytes += record_bytes
    try:
        return ChatPrompt(chat_body(body, history), source_bytes)
    except Unreadable:
        return None
