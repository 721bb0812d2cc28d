"""The KV index's Redis schema: what replicas write and routers read, defined once.

Replicas write it (kvscale.server.engine.kv_publisher), routers read it (kvscale.router.redis_feed);
docs/router.md describes it:

  kvscale:replicas                    ZSET  live replica ids, scored by the Redis server's clock
                                            (seconds) at their last heartbeat
  kvscale:replica:{id}:blocks         SET   decimal block hashes the replica's prefix cache holds
  kvscale:replica:{id}:seq            STRING event sequence number of the latest change to :blocks
  kvscale:replica:{id}:heartbeat      STRING JSON load report (the Heartbeat dataclass's fields),
                                            expires after HEARTBEAT_TTL_S
  kvscale:lora:runtime-adapters       HASH  adapter name -> the path it was loaded from: the adapters
                                            loaded at run time through a router, which every router
                                            loads onto a replica that lacks them (RUNTIME_ADAPTERS_KEY)
  kvscale:kv-events                   PUB/SUB channel, JSON messages:
      {"replica": id, "seq": n, "events": [["stored", [h, ...]], ["removed", [h, ...]], ["cleared"]]}
      {"replica": id, "seq": n, "snapshot": true}   (the :blocks set was rewritten; reload it)
      {"replica": id, "seq": n, "gone": true}       (clean shutdown, or membership expired)

Membership expires by itself: a member whose score is older than MEMBERSHIP_TTL_S is pruned,
with its :blocks, :seq and :heartbeat keys and a ``gone`` message, by whichever publisher or
router touches the set next (both run the prune script every heartbeat or poll). The scores and
the cut-off use the Redis server's clock, so clock skew between machines never expires a live
replica. As a backstop :blocks and :seq carry the same TTL, renewed by every heartbeat. A
replica that finds itself re-added (it was pruned while alive, e.g. stalled for MEMBERSHIP_TTL_S)
resyncs its block set.

Each batch updates :blocks, bumps :seq and publishes in one MULTI/EXEC, so a router that reads
(:seq, :blocks) atomically and then applies only messages with a higher seq never misses or
double-applies a change; a gap in seq tells it to reload.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def redacted_url(url: str) -> str:
    """The Redis URL with its password replaced, for logs and errors (the URL comes from a
    Secret): the one in its user part, and redis-py's ``?password=`` query parameter."""
    import re
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


KEY_PREFIX = "kvscale"
REPLICAS_KEY = f"{KEY_PREFIX}:replicas"
EVENTS_CHANNEL = f"{KEY_PREFIX}:kv-events"
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5
# A replica silent this long (no heartbeat) is no longer a member; its keys go with it.
MEMBERSHIP_TTL_S = 10
BLOCKS_TTL_S = MEMBERSHIP_TTL_S

# Shared by the heartbeat and the readers' membership query: drop members whose last heartbeat
# is older than ARGV[1] seconds by the server's clock, with their keys, and tell the routers.
# Key names follow blocks_key/seq_key/heartbeat_key below (ARGV[2] is KEY_PREFIX).
_PRUNE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local cutoff = now - tonumber(ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. cutoff)
for _, id in ipairs(dead) do
  local base = ARGV[2] .. ':replica:' .. id
  redis.call('DEL', base .. ':blocks', base .. ':seq', base .. ':heartbeat')
  redis.call('ZREM', KEYS[1], id)
  redis.call('PUBLISH', ARGV[3], cjson.encode({replica = id, seq = 0, gone = true}))
end
"""
# KEYS: replicas, heartbeat, blocks, seq; ARGV: ttl, prefix, channel, id, payload, heartbeat ttl.
# Returns 1 when the replica was not a member (first heartbeat, or pruned while alive).
_HEARTBEAT_LUA = _PRUNE_LUA + """
local added = redis.call('ZADD', KEYS[1], now, ARGV[4])
redis.call('SET', KEYS[2], ARGV[5], 'EX', tonumber(ARGV[6]))
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[1]))
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[1]))
return added
"""
# KEYS: replicas; ARGV: ttl, prefix, channel. Returns the live members.
_LIVE_MEMBERS_LUA = _PRUNE_LUA + """
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


def live_replicas_script(client: Any) -> Any:
    """A callable for ``client`` (sync or asyncio redis): prune expired members, return the live ids.

    Call it as ``script(keys=[REPLICAS_KEY], args=live_replicas_args())``; answers are bytes.
    """
    return client.register_script(_LIVE_MEMBERS_LUA)


def live_replicas_args() -> list:
    return [MEMBERSHIP_TTL_S, KEY_PREFIX, EVENTS_CHANNEL]


def blocks_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}:replica:{replica_id}:blocks"


def seq_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}:replica:{replica_id}:seq"


def heartbeat_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}:replica:{replica_id}:heartbeat"


# Adapter names one heartbeat list carries at most: a replica registers at most 256 (the engine's
# MAX_LORA_NAMES), and a reader keeps no more whatever a heartbeat says.
MAX_PUBLISHED_LORAS = 256


def lora_names(value: Any) -> list[str]:
    """A heartbeat's list of adapter names, bounded and of strings only (absent: none)."""
    if not isinstance(value, list):
        return []
    return [name for name in value if isinstance(name, str)][:MAX_PUBLISHED_LORAS]


# Priority levels one heartbeat's running_by_priority carries at most; a reader keeps the least
# urgent ones whatever a heartbeat says: those are the sequences a more urgent request displaces.
MAX_PUBLISHED_PRIORITIES = 16


def priority_counts(value: Any) -> dict[int, int]:
    """A heartbeat's running sequences by priority, bounded, of integer levels and positive
    counts only (absent: none)."""
    if not isinstance(value, dict):
        return {}
    counts: dict[int, int] = {}
    for level, count in value.items():
        try:
            level_int = int(level)
        except (TypeError, ValueError):
            continue
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            counts[level_int] = count
    return dict(sorted(counts.items())[-MAX_PUBLISHED_PRIORITIES:])


# The adapters loaded at run time through a router (docs/router.md, "Loading adapters at run
# time"): written by the router that passed a load (HSET, through the script below) or an unload
# (HDEL) on, read by every router, which loads each onto any replica that lacks it. No TTL: a load
# holds until it is unloaded. At most as many as a replica registers, each name and path within
# the server's bounds on a load (server/entrypoints/serving_lora.py), however the hash was written.
RUNTIME_ADAPTERS_KEY = f"{KEY_PREFIX}:lora:runtime-adapters"
MAX_RUNTIME_ADAPTERS = MAX_PUBLISHED_LORAS
MAX_ADAPTER_NAME_CHARS = 256
MAX_ADAPTER_PATH_CHARS = 4096
# KEYS: the hash; ARGV: name, path, the most names. Adds or replaces unless the hash is full of
# other names; returns 1 when written.
_RECORD_LOAD_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HLEN', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return 1
end
return 0
"""


def record_load_script(client: Any) -> Any:
    """A callable for ``client`` that records one load: ``script(keys=[RUNTIME_ADAPTERS_KEY],
    args=[name, path, MAX_RUNTIME_ADAPTERS])``, 1 when recorded, 0 when the record is full."""
    return client.register_script(_RECORD_LOAD_LUA)


def runtime_adapters(raw: dict[Any, Any]) -> dict[str, str]:
    """The record as HGETALL answers it (bytes or str), bounded: the names and paths within the
    bounds, at most MAX_RUNTIME_ADAPTERS of them (the first by name)."""
    adapters = {}
    for name, path in raw.items():
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        path = path.decode(errors="replace") if isinstance(path, bytes) else str(path)
        if 0 < len(name) <= MAX_ADAPTER_NAME_CHARS and 0 < len(path) <= MAX_ADAPTER_PATH_CHARS:
            adapters[name] = path
    return dict(sorted(adapters.items())[:MAX_RUNTIME_ADAPTERS])


@dataclass
class Heartbeat:
    """One replica's load report, as written to :heartbeat (JSON) and read by routers."""

    replica_id: str
    model: str
    base_url: str
    block_size: int
    num_running: int
    num_waiting: int
    kv_blocks_active: int
    kv_blocks_total: int
    timestamp: float  # the replica's wall clock when the stats below were taken
    received: float = 0.0  # the reader's monotonic clock (not in the JSON)
    kv_blocks_cached: int = 0
    events_dropped: int = 0
    # What a TTFT prediction needs (kvscale.router.policy.predicted_ttft):
    prefill_tokens_waiting: int = 0  # prompt tokens queued or mid-prefill, not computed yet
    num_decoding: int = 0  # sequences past their prefill
    prefill_tokens_per_s: float = 0.0  # moving average over steps that prefilled (0: not measured)
    decode_step_s: float = 0.0  # moving average of a decode-only step
    step_token_budget: int = 0  # most tokens one engine step computes (max_num_batched_tokens)
    # Most sequences one batch holds (max_num_seqs); 0 in a heartbeat from a replica before it
    # published it: the router then counts no wait for a batch slot there.
    max_num_seqs: int = 0
    # LoRA adapters (docs/router.md, "LoRA adapters"): those registered here, those resident in its
    # device slots now, those of running requests, and the slots (max_loras; 0: LoRA off). Each
    # list at most MAX_PUBLISHED_LORAS names, so a replica's heartbeat stays small.
    lora_adapters: list[str] = field(default_factory=list)
    lora_resident: list[str] = field(default_factory=list)
    lora_running: list[str] = field(default_factory=list)
    max_loras: int = 0
    # Running sequences by their priority (lower is more urgent; all 0 under fcfs), at most
    # MAX_PUBLISHED_PRIORITIES levels: what a more urgent request displaces there under
    # --scheduling-policy priority (router/band_preemption.py).
    running_by_priority: dict[int, int] = field(default_factory=dict)

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_active / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def to_json(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k not in ("replica_id", "received")}
        return json.dumps({"replica": self.replica_id, **fields})

    @classmethod
    def from_json(cls, replica_id: str, payload: str | bytes, received: float) -> Heartbeat:
        data = json.loads(payload)
        ints = ("block_size", "num_running", "num_waiting", "kv_blocks_active", "kv_blocks_total",
                "kv_blocks_cached", "events_dropped", "prefill_tokens_waiting", "num_decoding", "step_token_budget",
                "max_num_seqs", "max_loras")
        floats = ("timestamp", "prefill_tokens_per_s", "decode_step_s")
        numbers: dict[str, Any] = {k: int(data.get(k, 0)) for k in ints}
        numbers.update({k: float(data.get(k, 0.0)) for k in floats})
        return cls(
            replica_id=replica_id, model=str(data.get("model", "")), base_url=str(data.get("base_url", "")),
            received=received, **numbers, lora_adapters=lora_names(data.get("lora_adapters")),
            lora_resident=lora_names(data.get("lora_resident")), lora_running=lora_names(data.get("lora_running")),
            running_by_priority=priority_counts(data.get("running_by_priority")),
        )


def heartbeat_script(client: Any) -> Any:
    """A callable for ``client`` that writes one heartbeat and prunes expired members.

    Call it as ``script(keys=heartbeat_keys(id), args=heartbeat_args(id, payload))``; it returns 1
    when the replica was not a member (its first heartbeat, or it was pruned while alive).
    """
    return client.register_script(_HEARTBEAT_LUA)


def heartbeat_keys(replica_id: str) -> list[str]:
    return [REPLICAS_KEY, heartbeat_key(replica_id), blocks_key(replica_id), seq_key(replica_id)]


def heartbeat_args(replica_id: str, payload: str) -> list:
    return [MEMBERSHIP_TTL_S, KEY_PREFIX, EVENTS_CHANNEL, replica_id, payload, HEARTBEAT_TTL_S]


# One KV event on the wire: ["stored", [hash, ...]], ["removed", [hash, ...]] or ["cleared"].
# A stored/removed event about the replica's second KV tier (host memory, --kv-offloading-size)
# carries the tier as a third element: ["stored", [hash, ...], 2]; without it the tier is 1 (the
# KV cache itself). A demotion is ["removed", [h]] then ["stored", [h], 2], a promotion the
# reverse, so :blocks (which ignores the tier) holds every hash the replica can serve from either
# tier, and a reader that ignores the tier still knows the replica holds a demoted prefix.
# Snapshots carry no tier: after a reload a reader takes every hash as tier 1 until events say
# otherwise (an optimistic estimate, corrected as blocks move).
STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
TIER_DEVICE = 1
TIER_HOST = 2


def event_tier(event: list) -> int:
    """The tier a stored/removed event is about (1 when it does not say)."""
    return int(event[2]) if len(event) > 2 else TIER_DEVICE


def events_message(replica_id: str, seq: int, events: list[list]) -> str:
    return json.dumps({"replica": replica_id, "seq": seq, "events": events})


def snapshot_message(replica_id: str, seq: int) -> str:
    """The replica's :blocks set was rewritten whole; readers reload it."""
    return json.dumps({"replica": replica_id, "seq": seq, "snapshot": True})


def gone_message(replica_id: str, seq: int) -> str:
    """The replica left (clean shutdown); readers drop it now instead of at the TTL."""
    return json.dumps({"replica": replica_id, "seq": seq, "gone": True})
