"""Stored responses (``store: true``): what ``previous_response_id`` continues and
``GET``/``DELETE /v1/responses/{id}`` read (docs/server.md "The Responses API").

``ResponseStore`` is the interface: async, and a record is bytes (its JSON), so the store shared
by the fleet in Redis (responses_store_redis.py) takes its place without the endpoint changing. ``MemoryResponseStore``
is today's: in this process, bounded by entry count and total bytes (least recently used
evicted first) and by a time to live, so no client can grow the server's memory by storing.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """A response as answered, and the conversation it ended (chat messages as JSON, without
    ``instructions``), which the next turn's ``previous_response_id`` continues."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]

    def to_bytes(self) -> bytes:
        return json.dumps({"response": self.response, "conversation": self.conversation},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredResponse:
        fields = json.loads(data)
        return cls(fields["response"], fields["conversation"])


class StoreUnavailable(Exception):
    """The store could not be reached (a shared store's server is down): a 503, never a 404."""


class ResponseStore(Protocol):
    async def put(self, response_id: str, record: StoredResponse) -> bool:
        """Keep ``record``; False when it alone is larger than the store takes."""

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str) -> bool:
        """True when the id was stored."""


class MemoryResponseStore:
    """Records in this process: at most ``max_entries`` of them and ``max_bytes`` in all, the
    least recently used evicted first, each forgotten ``ttl_s`` after it was stored."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("a response store needs room for one entry, one byte and a positive TTL")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # id -> (expiry, record)
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, response_id: str) -> None:
        _, data = self._entries.pop(response_id)
        self.total_bytes -= len(data)

    def _expire(self) -> None:
        # Expiry times grow in insertion order, not in LRU order: scan all (bounded by max_entries).
        now = self._clock()
        for response_id in [key for key, (expiry, _) in self._entries.items() if expiry <= now]:
            self._drop(response_id)

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        data = record.to_bytes()
        if len(data) > self.max_bytes:
            return False
        if response_id in self._entries:
            self._drop(response_id)
        self._expire()
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.total_bytes + len(data) > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = (self._clock() + self.ttl_s, data)
        self.total_bytes += len(data)
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return StoredResponse.from_bytes(entry[1])

    async def delete(self, response_id: str) -> bool:
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True
