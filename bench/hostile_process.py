"""The hostile clients in a process of their own, for `bench/soak.py --hostile`.

Real attackers are other machines: their work takes nothing from an honest client's event loop.
In the soak's own process they did: the honest clients' time to first chunk, read on the loop
they shared, included waiting for the attackers' callbacks (the loop's lag is in the report,
bench/soak_breakdown.py). So they run here, in a spawned child with its own interpreter and
loop; both still share the host's cores with the platform, as any client on the same machine.

The child runs ``run_hostile`` until the parent sets ``stop``, then lets what is still open end
within a grace (a bomb in flight: up to its deadline), gives up the rest as a leaving client
would, and sends its ``HostileStats`` back. Its ``time.monotonic`` readings (each bomb's span) are
comparable with the parent's: on Linux both read the system-wide CLOCK_MONOTONIC.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from bench.hostile_clients import HostileStats, run_hostile

PROGRESS_EVERY_S = 15.0
STOP_POLL_S = 0.2
# Past the grace and the bombs' deadline: the child is given this long to send its counts.
COLLECT_MARGIN_S = 60.0


@dataclass(frozen=True)
class HostileSettings:
    routers: list[str]
    api_key: str | None
    bomb_sequences: int
    bomb_deadline_s: float
    grace_s: float  # what is open at the stop gets this long (a bomb: up to its deadline)


def grace_left(settings: HostileSettings, bomb_in_flight_since: float | None, now: float) -> float:
    """How long, from ``now``, what the clients have open at the stop may take to end: the grace,
    or longer while a bomb is in flight, so that every bomb sent ends with an outcome to judge."""
    if bomb_in_flight_since is None:
        return settings.grace_s
    return max(settings.grace_s, bomb_in_flight_since + settings.bomb_deadline_s + 1 - now)


async def _run(settings: HostileSettings, stats: HostileStats, stop: Any) -> None:
    stopped = asyncio.Event()
    hostile = asyncio.create_task(run_hostile(settings.routers, stats, stopped, settings.api_key,
                                              settings.bomb_sequences,
                                              bomb_deadline_s=settings.bomb_deadline_s))
    last_report = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(STOP_POLL_S)
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            last_report = time.monotonic()
            sent = {kind: n for kind, n in stats.as_dict()["sent"].items() if n}
            print(f"hostile clients answered {sent}", file=sys.stderr, flush=True)
    stopped.set()
    grace = grace_left(settings, stats.bomb_in_flight_since, time.monotonic())
    done, _ = await asyncio.wait({hostile}, timeout=grace)
    if not done:
        stats.cancelled_at_end = True
        hostile.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hostile


def child_main(settings: HostileSettings, stop: Any, conn: Connection) -> None:
    """The child's body: the clients until ``stop``, then their counts through ``conn``."""
    stats = HostileStats()
    try:
        asyncio.run(_run(settings, stats, stop))
    except Exception as exc:  # noqa: BLE001 - reported with the counts so far, not lost
        stats.loop_errors.append(f"hostile process: {type(exc).__name__}: {exc}")
    conn.send(stats)
    conn.close()


class HostileProcess:
    """The parent's handle: ``start``, then ``stop_and_collect`` once the honest load is done."""

    def __init__(self, settings: HostileSettings) -> None:
        self.settings = settings
        # spawn, not fork: the parent runs threads (the platform's log readers, httpx pools).
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._send = send
        self._process = context.Process(target=child_main, args=(settings, self._stop, send),
                                        name="kvscale-soak-hostile", daemon=True)

    def start(self) -> int:
        self._process.start()
        self._send.close()  # the child's end: the parent keeps only its reading end
        assert self._process.pid is not None
        return self._process.pid

    def kill(self) -> None:
        """Ends the clients at once, counts lost (the soak failed before it could collect them)."""
        self._process.kill()
        self._process.join(timeout=10)

    def stop_and_collect(self) -> HostileStats:
        """Tells the clients to stop and waits for their counts: a stats object with a loop error
        if the child died or sent nothing within the grace, the bombs' deadline and a margin."""
        self._stop.set()
        wait_s = self.settings.grace_s + self.settings.bomb_deadline_s + COLLECT_MARGIN_S
        stats: HostileStats | None = None
        try:
            if self._receive.poll(wait_s):
                stats = self._receive.recv()
        except EOFError:  # the child died before sending
            stats = None
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        if stats is None:
            stats = HostileStats()
            stats.loop_errors.append(f"hostile process sent no counts (exit code {self._process.exitcode})")
        return stats
