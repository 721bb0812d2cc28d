"""Stored /v1/responses in Redis: the keys and scripts every replica and router of one
model agrees on, defined once (docs/server.md "The Responses API").

  kvscale:responses:{model}:record:{id}   STRING  the record's JSON, {"response": ..., "conversation": [...]};
                                                  expires ttl_s after it was stored
  kvscale:responses:{model}:used          ZSET    ids scored by their last use (Redis server clock, s)
  kvscale:responses:{model}:expires       ZSET    ids scored by their expiry time
  kvscale:responses:{model}:sizes         HASH    id -> the record's bytes
  kvscale:responses:{model}:bytes         STRING  the records' bytes in all

Each script runs atomically: a put first forgets what expired, then evicts the least recently
used until the new record fits both bounds (entries and bytes) shared by the whole fleet; a get
refreshes its id's last use. The scripts build record keys from their prefix, so the store
wants one Redis, not a cluster (as the KV index does).
"""

from __future__ import annotations

import json
from typing import Any

KEY_PREFIX = "kvscale:responses"


def keys(model: str) -> tuple[str, str, str, str, str]:
    """(record key prefix, used, expires, sizes, bytes) for one model's stored responses."""
    base = f"{KEY_PREFIX}:{model}"
    return f"{base}:record:", f"{base}:used", f"{base}:expires", f"{base}:sizes", f"{base}:bytes"


def record_key(model: str, response_id: str) -> str:
    """The key of one stored response's record, which a reader that only reads (a router) GETs."""
    return keys(model)[0] + response_id


def record_conversation(record: bytes) -> list[dict[str, Any]] | None:
    """The conversation a record ends (its ``conversation``: the chat messages as JSON, input and
    answer, without ``instructions``), or None when the record is not one."""
    try:
        fields = json.loads(record)
    except ValueError:
        return None
    conversation = fields.get("conversation") if isinstance(fields, dict) else None
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        return None
    return conversation


_DROP = """
local used, expires, sizes, total, prefix = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1]
local function drop(member)
  local size = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('HDEL', sizes, member)
  redis.call('ZREM', used, member)
  redis.call('ZREM', expires, member)
  redis.call('DEL', prefix .. member)
  redis.call('DECRBY', total, size)
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""

# KEYS: used, expires, sizes, bytes; ARGV: prefix, id, record, ttl_s, max_entries, max_bytes.
# Returns 1 when stored, 0 when the record alone is larger than max_bytes.
PUT_SCRIPT = _DROP + """
local id, record = ARGV[2], ARGV[3]
local ttl, max_entries, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local size = string.len(record)
if size > max_bytes then return 0 end
if redis.call('ZSCORE', used, id) then drop(id) end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', expires, '-inf', now)) do drop(member) end
while redis.call('ZCARD', used) >= max_entries or tonumber(redis.call('GET', total) or '0') + size > max_bytes do
  local oldest = redis.call('ZRANGE', used, 0, 0)[1]
  if not oldest then break end
  drop(oldest)
end
redis.call('SET', prefix .. id, record, 'PX', math.max(1, math.floor(ttl * 1000)))
redis.call('ZADD', used, now, id)
redis.call('ZADD', expires, now + ttl, id)
redis.call('HSET', sizes, id, size)
redis.call('INCRBY', total, size)
return 1
"""

# KEYS as PUT_SCRIPT; ARGV: prefix, id. The record, or nil.
GET_SCRIPT = _DROP + """
local record = redis.call('GET', prefix .. ARGV[2])
if record then redis.call('ZADD', used, 'XX', now, ARGV[2]) elseif redis.call('ZSCORE', used, ARGV[2]) then
  drop(ARGV[2])
end
return record
"""

# KEYS as PUT_SCRIPT; ARGV: prefix, id. 1 when the id was stored (and not expired).
DELETE_SCRIPT = _DROP + """
local stored = redis.call('EXISTS', prefix .. ARGV[2])
if redis.call('ZSCORE', used, ARGV[2]) then drop(ARGV[2]) end
return stored
"""
