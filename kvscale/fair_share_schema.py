"""Tenants' fair-share counters in Redis, defined once (docs/router.md, "Fair share across
routers").

Every router of a fleet with ``--tenants`` and ``--max-queue-wait`` keeps its tenants' virtual
token counters (router/fair_share.py) in the Redis the KV index already uses, so that two routers
in front of one fleet order the same waiting tenants the same way:

  kvscale:tenant:{name}:fair-share   STRING  the tenant's counter: tokens served / its weight,
                                             lifted as fair_share.lifted says
  kvscale:fair-share:last-served     STRING  the counter of the tenant any router let through last

Both expire COUNTER_TTL_S after their last change: a tenant idle that long comes back at the
floor (fair_share.lifted) whatever its counter was, so nothing is lost with it, and the keys are
only those of tenants served within the TTL (the tenants file holds at most MAX_TENANTS). One
script lifts and charges a counter in one atomic step, whichever router calls it.
"""

from __future__ import annotations

import math
from typing import Any

from kvscale.kv_index_schema import KEY_PREFIX

COUNTER_TTL_S = 600
LAST_SERVED_KEY = f"{KEY_PREFIX}:fair-share:last-served"
# The floor a counter is lifted to before it is charged: none, the last served's, or (a list of
# tenants' names) the smallest of those tenants' counters: those waiting. Read in the script, so
# the fleet's counters, whatever this router's copy of them says.
NO_FLOOR = ""
LAST_SERVED = "last"
# Names one floor takes at most: as many as a tenants file lists (router/tenants.py).
MAX_FLOOR_TENANTS = 1000

# ARGV: prefix, tenant, floor mode ("" none, "last", "min"), tokens / weight to add, "1" when
# the tenant is the one let through now (the last served moves to its counter), TTL, then for
# "min" the names whose smallest counter is the floor. Returns {the tenant's counter, the last
# served's counter} as strings (a Lua number would come back truncated to an integer).
UPDATE_LUA = """
local key = ARGV[1] .. ':tenant:' .. ARGV[2] .. ':fair-share'
local last_key = ARGV[1] .. ':fair-share:last-served'
local counter = tonumber(redis.call('GET', key) or '0')
local last = tonumber(redis.call('GET', last_key) or '0')
local floor = nil
if ARGV[3] == 'last' then
  floor = last
elseif ARGV[3] == 'min' then
  for i = 7, #ARGV do
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


def counter_key(tenant: str) -> str:
    """A tenant's counter: the name the script builds."""
    return f"{KEY_PREFIX}:tenant:{tenant}:fair-share"


def update_script(client: Any) -> Any:
    """For ``client`` (sync or asyncio redis): call as ``script(keys=[], args=update_args(...))``."""
    return client.register_script(UPDATE_LUA)


Floor = str | list[str]


def update_args(tenant: str, floor: Floor, added: float, served: bool,
                ttl_s: int = COUNTER_TTL_S) -> list:
    """The script's arguments; an amount that is not a finite number, an unknown floor or one
    over more than MAX_FLOOR_TENANTS names is refused."""
    if not math.isfinite(added):
        raise ValueError(f"a fair-share counter takes finite numbers, not {added!r}")
    if isinstance(floor, list):
        if not 0 < len(floor) <= MAX_FLOOR_TENANTS:
            raise ValueError(f"a floor is the smallest of 1 to {MAX_FLOOR_TENANTS} counters, "
                             f"not of {len(floor)}")
        return [KEY_PREFIX, tenant, "min", repr(float(added)), "1" if served else "0", ttl_s,
                *floor]
    if floor not in (NO_FLOOR, LAST_SERVED):
        raise ValueError(f"a counter's floor is {LAST_SERVED!r}, none or a list of tenants, "
                         f"not {floor!r}")
    return [KEY_PREFIX, tenant, floor, repr(float(added)), "1" if served else "0", ttl_s]


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
