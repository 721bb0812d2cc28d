"""Where the hostile soak's honest TTFT goes, measured beside it (bench/soak.py --hostile):

- the CPU seconds each process of the platform took in each phase (a replica with its engine
  core), the soak's own (honest) client process and the hostile clients' process: the host has
  2 cores for all of them;
- the honest clients' event-loop lag (a busy loop delays the honest requests' first chunks as
  the client sees them; the hostile clients have a loop of their own, bench/hostile_process.py);
- the honest TTFT split by whether a 2,048-prompt bomb was in flight when the request was sent,
  and if so whether the bomb's replica served it; the same for a slow schema in flight (its
  compile holds its replica's CPU and, at times, its interpreter's lock).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Iterable
from typing import Any

import psutil

from bench.soak_client import Outcome
from bench.stats import nearest_rank

LAG_PERIOD_S = 0.05


# Counted without their children: the soak client's children are the platform's processes,
# each counted under its own name.
OWN_ONLY = frozenset({"soak_client"})


def cpu_seconds(pids: dict[str, int], own_only: frozenset[str] = OWN_ONLY) -> dict[str, float]:
    """User plus system CPU seconds of each named process and its children (a replica's engine
    core is a child), of the process alone for a name in ``own_only``; 0 for one that is gone.
    Besides: ``host_busy``, every process's on the host, and ``host_steal``, the hypervisor's."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        total = 0.0
        try:
            proc = psutil.Process(pid)
            for each in [proc, *([] if name in own_only else proc.children(recursive=True))]:
                times = each.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
        out[name] = total
    # The whole host beside them: what else ran (another process, in another autogroup nice does
    # not hold back) and what the hypervisor took (steal), so a run that was not quiet shows it.
    host = psutil.cpu_times()
    out["host_busy"] = host.user + host.nice + host.system + getattr(host, "irq", 0.0) + getattr(host, "softirq", 0.0)
    out["host_steal"] = getattr(host, "steal", 0.0)
    return out


def cpu_share(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores each process used on average between two ``cpu_seconds``."""
    return {name: round((after.get(name, 0.0) - before.get(name, 0.0)) / wall_s, 3) for name in before}


async def with_loop_lag(work: Awaitable[Any], lags: list[float]) -> Any:
    """``work``, while the loop's lateness waking from a short sleep is sampled into ``lags``."""
    async def sample() -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(LAG_PERIOD_S)
            lags.append(time.monotonic() - began - LAG_PERIOD_S)

    sampler = asyncio.create_task(sample())
    try:
        return await work
    finally:
        sampler.cancel()


def lag_summary(lags: list[float]) -> dict[str, float | None]:
    return {"samples": len(lags), "p50_ms": _ms(nearest_rank(lags, 0.5)), "p90_ms": _ms(nearest_rank(lags, 0.9)),
            "max_ms": _ms(max(lags, default=None))}


def ttft_by_bomb(outcomes: Iterable[Outcome],
                 bomb_spans: list[tuple[float, float, str | None]]) -> dict[str, Any]:
    """``ttft_by_spans`` of the bombs."""
    return ttft_by_spans(outcomes, bomb_spans, "bomb")


def ttft_by_spans(outcomes: Iterable[Outcome], spans: list[tuple[float, float, str | None]],
                  what: str) -> dict[str, Any]:
    """Honest TTFT p50/p90 of the requests sent while none of ``spans`` (hostile requests' sent,
    answered and replica) was open, and of those sent while one was, split by whether the
    request was served by that replica (a replica not known on either side counts as another)."""
    none, other, same = f"no_{what}", f"{what}_on_another_replica", f"{what}_on_same_replica"
    sides: dict[str, list[float]] = {none: [], other: [], same: []}
    for outcome in outcomes:
        if outcome.hung_up or outcome.first_chunk_s is None:
            continue
        during = [replica for start, end, replica in spans if start <= outcome.started <= end]
        if not during:
            side = none
        elif outcome.replica is not None and outcome.replica in during:
            side = same
        else:
            side = other
        sides[side].append(outcome.first_chunk_s)
    return {side: {"requests": len(v), "ttft_p50_s": nearest_rank(v, 0.5), "ttft_p90_s": nearest_rank(v, 0.9)}
            for side, v in sides.items()}


def platform_pids(children: dict[str, Any]) -> dict[str, int]:
    """The soak client itself and each named child's process id."""
    return {"soak_client": os.getpid(), **{name: child.proc.pid for name, child in children.items()}}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
