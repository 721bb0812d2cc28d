"""The chaos soak's fault schedule: at fixed fractions of the run a replica is SIGKILLed and
started again, another SIGTERMed like a rolling update, Redis killed and restarted, a router
SIGTERMed and started again; each fault recorded with its window."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field

from bench.soak_platform import Platform
from kvscale.router.cli_up import Child


@dataclass
class Fault:
    name: str
    at: float
    until: float | None = None
    target: str | None = None
    notes: list[str] = field(default_factory=list)


def _wait_exit(child: Child, timeout: float) -> int | None:
    try:
        return child.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def chaos(platform_: Platform, progress, faults: list[Fault], stop: list[bool], timeout: float,
          finished: list[bool]) -> None:
    """The schedule, run in a thread; ``progress()`` is the fraction of requests finished.

    The thread then waits for ``stop``: children get PR_SET_PDEATHSIG, which fires when the
    *thread* that started them ends, so the processes it restarted live only as long as it does.
    """
    try:
        _schedule(platform_, progress, faults, stop, timeout)
    finally:
        finished[0] = True
        while not stop[0]:
            time.sleep(0.1)


def _schedule(platform_: Platform, progress, faults: list[Fault], stop: list[bool], timeout: float) -> None:

    def at(fraction: float) -> bool:
        while progress() < fraction:
            if stop[0]:
                return False
            time.sleep(0.05)
        return True

    names = platform_.names
    if not at(0.15):
        return
    fault = Fault("sigkill_replica", time.monotonic(), target=names[0])
    faults.append(fault)
    platform_.replicas[names[0]].proc.kill()
    platform_.replicas[names[0]].proc.wait()
    platform_.start_replica(names[0])
    platform_.stack.wait_healthy([platform_.replicas[names[0]]], timeout)
    fault.until = time.monotonic()

    if not at(0.35):
        return
    fault = Fault("sigterm_replica", time.monotonic(), target=names[1])
    faults.append(fault)
    child = platform_.replicas[names[1]]
    child.proc.send_signal(signal.SIGTERM)
    code = _wait_exit(child, 60)
    fault.notes.append(f"exit code {code} after {time.monotonic() - fault.at:.1f} s")
    platform_.start_replica(names[1])
    platform_.stack.wait_healthy([platform_.replicas[names[1]]], timeout)
    fault.until = time.monotonic()

    if not at(0.55):
        return
    fault = Fault("redis_restart", time.monotonic(), target="redis")
    faults.append(fault)
    assert platform_.redis is not None
    platform_.redis.proc.kill()
    platform_.redis.proc.wait()
    time.sleep(3.0)
    platform_.start_redis()
    time.sleep(3.0)  # replicas resync, routers reload
    fault.until = time.monotonic()

    if not at(0.75):
        return
    fault = Fault("router_restart", time.monotonic(), target="router-a")
    faults.append(fault)
    child = platform_.routers["router-a"]
    child.proc.send_signal(signal.SIGTERM)
    code = _wait_exit(child, 60)
    fault.notes.append(f"exit code {code} after {time.monotonic() - fault.at:.1f} s")
    platform_.start_router("router-a")
    platform_.stack.wait_healthy([platform_.routers["router-a"]], timeout)
    fault.until = time.monotonic()
