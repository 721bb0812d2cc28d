"""Tenants' rate limits in Redis, and the header naming a request's tenant: defined once.

Every router of a fleet admits a tenant's requests against the same counters, in the Redis the
KV index already uses (docs/router.md, "Tenants"). A window is fixed and 60 s long, numbered by
the Redis server's clock (``TIME``), so routers on machines whose clocks disagree still count in
the same window:

  kvscale:tenant:{name}:window:{n}:requests   STRING  requests admitted in window n
  kvscale:tenant:{name}:window:{n}:tokens     STRING  tokens reserved in window n (prompt tokens
                                                      plus the completion asked for), corrected
                                                      when the answer reports its usage

Both expire one second after their window ends. One script admits a request (reads, decides and
counts in one atomic step, so the N+1-th request of a window is refused whichever router it
reaches); another corrects a reservation in the window it was made in.
"""

from __future__ import annotations

from typing import Any

from kvscale.kv_index_schema import KEY_PREFIX

WINDOW_S = 60
# The tenant's name, set by the router on every request it forwards (a client's own is dropped):
# a replica trusts it only from the router.
TENANT_HEADER = "x-kvscale-tenant"

# ARGV: prefix, tenant, window seconds, requests limit, tokens limit (0: none), tokens asked.
# Returns {over ("" | "requests" | "tokens"), requests counted, tokens counted, ms to the window's
# end, window number}; the counts include this request when it is admitted.
ADMIT_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window_ms = tonumber(ARGV[3]) * 1000
local window = math.floor(now_ms / window_ms)
local base = ARGV[1] .. ':tenant:' .. ARGV[2] .. ':window:' .. window
local rk, tk = base .. ':requests', base .. ':tokens'
local requests = tonumber(redis.call('GET', rk) or '0')
local tokens = tonumber(redis.call('GET', tk) or '0')
local rpm, tpm, cost = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local reset_ms = (window + 1) * window_ms - now_ms
local over = ''
if rpm > 0 and requests + 1 > rpm then
  over = 'requests'
elseif tpm > 0 and tokens + cost > tpm then
  over = 'tokens'
else
  requests = redis.call('INCR', rk)
  tokens = redis.call('INCRBY', tk, cost)
  redis.call('PEXPIRE', rk, reset_ms + 1000)
  redis.call('PEXPIRE', tk, reset_ms + 1000)
end
return {over, requests, tokens, reset_ms, window}
"""
# ARGV: prefix, tenant, window number, tokens to add (negative: to give back). A window that has
# ended and expired is left alone (its counts no longer limit anyone).
CORRECT_LUA = """
local tk = ARGV[1] .. ':tenant:' .. ARGV[2] .. ':window:' .. ARGV[3] .. ':tokens'
if redis.call('EXISTS', tk) == 1 then
  return redis.call('INCRBY', tk, tonumber(ARGV[4]))
end
return false
"""


def window_key(tenant: str, window: int, counter: str) -> str:
    """A window's counter (``requests`` or ``tokens``): the names the scripts build."""
    return f"{KEY_PREFIX}:tenant:{tenant}:window:{window}:{counter}"


def admit_script(client: Any) -> Any:
    """For ``client`` (sync or asyncio redis): call as ``script(keys=[], args=admit_args(...))``."""
    return client.register_script(ADMIT_LUA)


def admit_args(tenant: str, requests_limit: int | None, tokens_limit: int | None,
               tokens: int) -> list:
    return [KEY_PREFIX, tenant, WINDOW_S, requests_limit or 0, tokens_limit or 0, tokens]


def correct_script(client: Any) -> Any:
    return client.register_script(CORRECT_LUA)


def correct_args(tenant: str, window: int, delta: int) -> list:
    return [KEY_PREFIX, tenant, window, delta]
