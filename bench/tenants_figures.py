"""The tenant benchmark's figures from its per-request records, as pure functions (bench.tenants):
whether a rate limit was exact, the service gap between two backlogged tenants and VTC's bound
on it, a latency's summary, and the targets' verdicts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bench.stats import quantile

RATE_LIMIT_CODE = "rate_limit_exceeded"  # OpenAI's error code for a 429 over a limit


def limit_outcome(answers: Sequence[Mapping[str, Any]], limit: int) -> dict[str, Any]:
    """What a tenant with ``requests_per_minute: limit`` got for requests sent one after the
    other within one window (each answer: ``status``, ``retry_after``, ``error_code``). Exact:
    the first ``limit`` let in, every later one a 429 with ``Retry-After`` and OpenAI's code."""
    statuses = [a["status"] for a in answers]
    refused = [a for a in answers if a["status"] == 429]
    first_refused = next((i + 1 for i, s in enumerate(statuses) if s == 429), None)
    well_formed = all(a.get("retry_after") and a.get("error_code") == RATE_LIMIT_CODE for a in refused)
    return {
        "sent": len(answers),
        "admitted": statuses.count(200),
        "refused": len(refused),
        "other": len(answers) - statuses.count(200) - len(refused),
        "first_refused": first_refused,
        "refusals_well_formed": well_formed,
        "exact": (statuses[:limit] == [200] * limit and statuses[limit:] == [429] * (len(answers) - limit)
                  and well_formed),
    }


def service_gap(served: Iterable[tuple[float, str, int]], first: str, second: str,
                start: float, end: float) -> int:
    """The largest difference in tokens served to ``first`` and ``second`` over any window within
    [start, end]: ``served`` holds (time a request ended, its tenant, its tokens). With D(t) the
    tokens served to ``first`` minus those to ``second`` since ``start``, the gap over [t1, t2]
    is D(t2) - D(t1), so the largest over every window is max D - min D."""
    difference = highest = lowest = 0
    for _, tenant, tokens in sorted(s for s in served if start <= s[0] <= end):
        if tenant == first:
            difference += tokens
        elif tenant == second:
            difference -= tokens
        highest, lowest = max(highest, difference), min(lowest, difference)
    return highest - lowest


def vtc_bound(largest_prompt: int, largest_request: int, batch_requests: int, kv_tokens: int) -> int:
    """VTC's bound on the service gap between two backlogged clients of equal weight (Sheng et
    al., OSDI'24: 2 x max(w_p x L_input, w_q x M)), with w_p = w_q = 1 as the router charges
    prompt and completion tokens alike. L_input is the largest prompt; M the most tokens the
    fleet's batch can hold: its ``batch_requests`` slots each with at most the largest request,
    and never more than its KV cache's ``kv_tokens``."""
    batch_tokens = min(kv_tokens, batch_requests * largest_request)
    return 2 * max(largest_prompt, batch_tokens)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def at_most(value: float | None, target: float) -> str:
    """A target of the form "figure <= target"'s verdict."""
    if value is None or value != value:  # missing or NaN: nothing measured
        return "not measured"
    return "met" if value <= target else "not met"


def ms_summary(values: list[float]) -> dict[str, float | None]:
    """p50, p90 and the largest of latencies in milliseconds (NaN quantiles for none)."""
    return {"p50_ms": quantile(values, 0.5), "p90_ms": quantile(values, 0.9), "max_ms": max(values, default=None)}
