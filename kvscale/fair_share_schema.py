"""Tenants' fair-share counters in Redis, defined once (docs/router.md, "Fair share across
routers").

Every router of a fleet with ``--tenants`` and ``--max-queue-wait`` keeps its tenants' virtual
token counters (router/fair_share.py) in the Redis the KV index already uses, so that two routers
in front of one fleet order the same waiting tenants the same way:

  kvscale:tenant:{name}:fair-share   STRING  the tenant's counter: tokens served / its weight,
                                             lifted as fair_share.lifted says
  kvscale:fair-share:last-served     STRING  the counter of the tenant any router let through last
  kvscale:tenant:{name}:waiting      ZSET    the routers where the tenant has requests waiting:
                                             member a router's id, score when its word lapses

Both expire COUNTER_TTL_S after their last change: a tenant idle that long comes back at the
floor (fair_share.lifted) whatever its counter was, so nothing is lost with it, and the keys are
only those of tenants served within the TTL (the tenants file holds at most MAX_TENANTS). One
script lifts and charges a counter in one atomic step, whichever router calls it.

A tenant is lifted only when it waits at no router of the fleet: a router where its queue just
emptied would otherwise lift a tenant still backlogged at the others, taking the credit the
fleet owes it (VTC's bound holds for tenants backlogged throughout; with a router's own queue as
the measure, a tenant's short requests drained there and each return cost it up to a request).
A router says where tenants wait with a second script, when a tenant's queue there fills or
empties and again every tick while it waits; its word lapses after WAITING_TTL_S, so a router
that died stops holding anyone's lift.
"""

from __future__ import annotations

import math
from typing import Any

from kvscale.kv_index_schema import KEY_PREFIX

COUNTER_TTL_S = 600
# A router renews the tenants waiting there every tick (a quarter of a second): eight ticks.
WAITING_TTL_S = 2.0
LAST_SERVED_KEY = f"{KEY_PREFIX}:fair-share:last-served"
# The floor a counter is lifted to before it is charged: none, the last served's, or (a list of
# tenants' names) the smallest of those tenants' counters: those waiting. Read in the script, so
# the fleet's counters, whatever this router's copy of them says.
NO_FLOOR = ""
LAST_SERVED = "last"
# Names one floor takes at most: as many as a tenants file lists (router/tenants.py).
MAX_FLOOR_TENANTS = 1000

# ARGV: prefix, tenant, floor mode ("" none, "last", "min"), tokens / weight to add, "1" when
# the tenant is the one let through now (the last served moves to its counter), TTL, the calling
# router's id, then for "min" the names whose smallest counter is the floor. No floor applies
# while another router says the tenant waits there. Returns {the tenant's counter, the last
# served's counter} as strings (a Lua number would come back truncated to an integer).
UPDATE_LUA = """
local key = ARGV[1] .. ':tenant:' .. ARGV[2] .. ':fair-share'
local last_key = ARGV[1] .. ':fair-share:last-served'
local counter = tonumber(redis.call('GET', key) or '0')
local last = tonumber(redis.call('GET', last_key) or '0')
local floor = nil
local mode = ARGV[3]
if mode ~= '' then
  local waiting_key = ARGV[1] .. ':tenant:' .. ARGV[2] .. ':waiting'
  local now = redis.call('TIME')
  redis.call('ZREMRANGEBYSCORE', waiting_key, '-inf', tonumber(now[1]) + tonumber(now[2]) / 1e6)
  local here = redis.call('ZSCORE', waiting_key, ARGV[7]) and 1 or 0
  if redis.call('ZCARD', waiting_key) > here then mode = '' end
end
if mode == 'last' then
  floor = last
elseif mode == 'min' then
  for i = 8, #ARGV do
    local other = tonumber(redis.call('GET', ARGV[1] .. ':tenant:' .. ARGV[i] .. ':fair-share') or '0')
    if floor == nil or other < floor then floor = other end
  end
end
if floor ~= nil and floor > counter then counter = floor end
counter = counter + tonumber(ARGV[4])
local ttl = tonumber(ARGV[6])
local text = string.format('%.17g', counter)
redis.call('SET', key, text, 'EX', ttl)
if ARGV[5] == '1' then
  last = counter
  redis.call('SET', last_key, text, 'EX', ttl)
end
return {text, string.format('%.17g', last)}
"""


# ARGV: prefix, the router's id, WAITING_TTL_S, "1" (they wait here now) or "0" (no longer), then
# the tenants' names. Returns how many names it took.
WAITING_LUA = """
local now = redis.call('TIME')
local until_s = tonumber(now[1]) + tonumber(now[2]) / 1e6 + tonumber(ARGV[3])
for i = 5, #ARGV do
  local waiting_key = ARGV[1] .. ':tenant:' .. ARGV[i] .. ':waiting'
  if ARGV[4] == '1' then
    redis.call('ZADD', waiting_key, until_s, ARGV[2])
    redis.call('EXPIRE', waiting_key, math.ceil(tonumber(ARGV[3])) * 2)
  else
    redis.call('ZREM', waiting_key, ARGV[2])
  end
end
return #ARGV - 4
"""


def waiting_key(tenant: str) -> str:
    """The routers where a tenant waits: the name the scripts build."""
    return f"{KEY_PREFIX}:tenant:{tenant}:waiting"


def waiting_args(router_id: str, tenants: list[str], waiting: bool,
                 ttl_s: float = WAITING_TTL_S) -> list:
    """WAITING_LUA's arguments: ``tenants`` wait at ``router_id`` now (or no longer)."""
    if not 0 < len(tenants) <= MAX_FLOOR_TENANTS:
        raise ValueError(f"a router says where 1 to {MAX_FLOOR_TENANTS} tenants wait, not {len(tenants)}")
    return [KEY_PREFIX, router_id, repr(float(ttl_s)), "1" if waiting else "0", *tenants]


def counter_key(tenant: str) -> str:
    """A tenant's counter: the name the script builds."""
    return f"{KEY_PREFIX}:tenant:{tenant}:fair-share"


def update_script(client: Any) -> Any:
    """For ``client`` (sync or asyncio redis): call as ``script(keys=[], args=update_args(...))``."""
    return client.register_script(UPDATE_LUA)


Floor = str | list[str]


def update_args(tenant: str, floor: Floor, added: float, served: bool, router_id: str = "",
                ttl_s: int = COUNTER_TTL_S) -> list:
    """The script's arguments, for the router ``router_id``; an amount that is not a finite
    number, an unknown floor or one over more than MAX_FLOOR_TENANTS names is refused."""
    if not math.isfinite(added):
        raise ValueError(f"a fair-share counter takes finite numbers, not {added!r}")
    if isinstance(floor, list):
        if not 0 < len(floor) <= MAX_FLOOR_TENANTS:
            raise ValueError(f"a floor is the smallest of 1 to {MAX_FLOOR_TENANTS} counters, "
                             f"not of {len(floor)}")
        return [KEY_PREFIX, tenant, "min", repr(float(added)), "1" if served else "0", ttl_s,
                router_id, *floor]
    if floor not in (NO_FLOOR, LAST_SERVED):
        raise ValueError(f"a counter's floor is {LAST_SERVED!r}, none or a list of tenants, "
                         f"not {floor!r}")
    return [KEY_PREFIX, tenant, floor, repr(float(added)), "1" if served else "0", ttl_s, router_id]


def counters_from(values: list[Any]) -> list[float | None]:
    """MGET's answer for some counters' keys: each a float, None where absent or unreadable."""
    out: list[float | None] = []
    for value in values:
        try:
            number = float(value) if value is not None else None
        except (TypeError, ValueError):
            number = None
        out.append(number if number is not None and math.isfinite(number) else None)
    return out
