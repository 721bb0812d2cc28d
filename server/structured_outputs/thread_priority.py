"""Lowering the calling thread's CPU priority, for background work beside the engine's OpenMP pool.

On a CPU node the engine core's OpenMP threads hold every core it was given, and each op ends in
a barrier that waits for the slowest of them: a background thread at their priority that takes
one core for a time slice stalls all of them for that slice. At a lower priority the kernel runs
it only where an OpenMP thread waits, and a waking OpenMP thread takes the core back at once
(SCHED_IDLE; nice 19 only lowers its share). Linux keeps both per thread, so a pool's
``initializer`` can lower its own workers and nothing else.

A lowered thread cannot raise itself back without privileges, so it is a thread for this work
alone; a thread it starts inherits the lowered priority.
"""

from __future__ import annotations

import logging
import os
import threading

from kvscale.server.config import PRIORITIES

logger = logging.getLogger(__name__)


def lower_this_thread(priority: str) -> str:
    """Put the calling thread at ``priority``; returns what it got (where the OS has no SCHED_IDLE
    or refuses it, the next lower step that works, else "normal": the work still runs)."""
    if priority not in PRIORITIES:
        raise ValueError(f"unknown thread priority {priority!r}: one of {', '.join(PRIORITIES)}")
    tid = threading.get_native_id()
    if priority == "idle":
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except (AttributeError, OSError) as exc:
            logger.debug("SCHED_IDLE refused (%s): trying nice 19", exc)
            priority = "nice"
    if priority == "nice":
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            return "nice"
        except (AttributeError, OSError) as exc:
            logger.debug("nice 19 refused (%s): the thread keeps the process's priority", exc)
    return "normal"

