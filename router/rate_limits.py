"""A tenant's rate limits as pure decisions: what a request costs, what the window's counts say
to the client (OpenAI's ``x-ratelimit-*`` headers, ``Retry-After``), and how a reservation is
settled once the answer reports its usage (docs/router.md, "Tenants").

The counting itself is one atomic script in Redis (kvscale.tenant_limits_schema); these
functions only read its answer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kvscale.router.client_watch import CLIENT_GONE
from kvscale.router.tenants import Tenant

# A prompt the router did not tokenize (no tokenizer for its model, or a policy that does not
# look at prompts) is charged by its request's size, about 4 bytes a token of English text; the
# answer's usage corrects it.
BYTES_PER_TOKEN = 4
# vLLM's (and the servers') default max_tokens for /v1/completions; chat has none: its completion
# is charged when it ends.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_N = 128
LIMIT_KINDS = ("requests", "tokens")
# The answer's tail kept to find its usage: a JSON answer ends with it, a stream's usage chunk
# (stream_options.include_usage) comes just before ``data: [DONE]``.
USAGE_TAIL_BYTES = 4096
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# Chat's and completions' names, and the Responses API's.
_FIELD = re.compile(rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)')


@dataclass(frozen=True)
class WindowCounts:
    """The admission script's answer: the window's counts, this request included when admitted."""

    over: str  # "" (admitted), "requests" or "tokens"
    requests: int
    tokens: int
    reset_ms: int  # to the window's end
    window: int  # its number, for the correction at completion

    @classmethod
    def from_script(cls, answer: list[Any]) -> WindowCounts:
        over = answer[0].decode() if isinstance(answer[0], bytes) else str(answer[0] or "")
        return cls(over, int(answer[1]), int(answer[2]), int(answer[3]), int(answer[4]))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def request_tokens(endpoint: str, body: dict[str, Any], prompt_tokens: int,
                   body_bytes: int) -> int:
    """Tokens reserved at admission: the prompt's (as the router counted them, else estimated
    from the body's size) plus the completion asked for, for each of its ``n`` choices."""
    prompt = prompt_tokens if prompt_tokens > 0 else math.ceil(body_bytes / BYTES_PER_TOKEN)
    if endpoint == "chat":
        asked = _count(body.get("max_completion_tokens")) or _count(body.get("max_tokens"))
    elif endpoint == "responses":
        asked = _count(body.get("max_output_tokens"))
    else:
        asked = (_count(body["max_tokens"]) if "max_tokens" in body
                 else COMPLETIONS_DEFAULT_MAX_TOKENS)
    n = min(_count(body.get("n")) or 1, MAX_N)
    return prompt + asked * n


def retry_after_s(reset_ms: int) -> int:
    """Whole seconds until the window ends (at least 1: a client retrying sooner is refused)."""
    return max(1, math.ceil(reset_ms / 1000))


def headers(tenant: Tenant, counts: WindowCounts) -> dict[str, str]:
    """OpenAI's rate-limit headers for each limit the tenant has (none for one it has not)."""
    out: dict[str, str] = {}
    for kind, limit, used in (("requests", tenant.requests_per_minute, counts.requests),
                              ("tokens", tenant.tokens_per_minute, counts.tokens)):
        if limit is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
            out[f"x-ratelimit-reset-{kind}"] = f"{counts.reset_ms / 1000:.3f}s"
    return out


def too_large(tenant: Tenant, cost: int) -> bool:
    """The request alone asks for more tokens than the tenant's whole window: no wait lets it in."""
    return tenant.tokens_per_minute is not None and cost > tenant.tokens_per_minute


def refusal_message(tenant: Tenant, counts: WindowCounts, cost: int) -> str:
    if counts.over == "requests":
        return (f"Rate limit reached for tenant {tenant.name} on requests per minute: limit "
                f"{tenant.requests_per_minute}, used {counts.requests}. Retry in "
                f"{retry_after_s(counts.reset_ms)} s.")
    if too_large(tenant, cost):
        return (f"Request too large for tenant {tenant.name} on tokens per minute: limit "
                f"{tenant.tokens_per_minute}, requested {cost} (prompt plus max_tokens). "
                "Lower max_tokens or the prompt.")
    return (f"Rate limit reached for tenant {tenant.name} on tokens per minute: limit "
            f"{tenant.tokens_per_minute}, used {counts.tokens}, requested {cost}. Retry in "
            f"{retry_after_s(counts.reset_ms)} s.")


def usage_tokens(tail: bytes) -> int | None:
    """Prompt plus completion tokens of the last ``usage`` object in an answer's tail, or None
    when it has none (a stream without include_usage, an error)."""
    starts = [m.end() for m in _USAGE.finditer(tail)]
    if not starts:
        return None
    fields = dict(reversed(_FIELD.findall(tail[starts[-1]:starts[-1] + 512])))
    if set(fields) not in ({b"prompt_tokens", b"completion_tokens"}, {b"input_tokens", b"output_tokens"}):
        return None
    return sum(int(v) for v in fields.values())


def settlement(reserved: int, used: int | None, status: int) -> int:
    """Tokens to add to the window at completion (negative: given back). The usage reported
    replaces the reservation; without one, an answer with an error status gives all of it back,
    and one answered otherwise, or left by its client while being served, keeps it."""
    if used is not None:
        return used - reserved
    return -reserved if status >= 400 and status != CLIENT_GONE else 0
