"""The threads that compile grammars: low-priority workers, and a rescuer for when they starve.

Workers run at ``compile_priority`` (SCHED_IDLE by default, thread_priority.py), so a compile
takes only CPU time the engine's OpenMP threads leave: at their priority it stalls every barrier
of every op for whole time slices (docs/server.md, "Measured and not kept"). While the engine decodes
that is next to nothing (~1.5 % of a CPU on a 2-vCPU Xeon with four streams): compiles wait for
the engine, by design, and compiler.py's wall-clock bound ends a wait that grows too long.

They must not wait for anything else. Any process at a normal priority in the same cgroup (a CPU
hog beside a test server) starves a SCHED_IDLE thread as much while the engine is idle. So one
more thread, the rescuer, stays at the process's priority and watches the workers' CPU clocks:
when they have had work but less than ``STARVED_SHARE`` of a CPU for ``starved_after_s`` while
the engine ran no forward pass (``forward_running``) and nothing was left to build (below), it
compiles the oldest unfinished job itself (a queued one is taken from the queue; a running one is
compiled again, and whichever copy finishes first serves), and the next, for as long as the
engine stays idle.

What every compile needs first (``prepare``: the grammar library's view of the tokenizer) is built
once, on the first job, by a thread of its own at the priority of the thread that made the pool
(the engine's), never by a worker: the build holds the GIL for its whole time (~0.2 s), and a
SCHED_IDLE thread preempted while it holds the GIL stalls every thread of the process, the
engine's included, until the kernel runs it again, which beside a busy neighbour may be seconds.

Each job records the CPU clock of every thread compiling it; its CPU time is the most any of them
has had (compiler.py's time limit counts that, not wall-clock time the scheduler never gave it).

A compile cannot be stopped from outside its thread, so one that runs past that limit is
abandoned instead (``abandon``): its thread finishes it (the grammar still lands in the cache)
and then ends, while a new worker takes the queue at once. Up to ``MAX_ABANDONED`` such threads
at a time, at the workers' low priority: a client's slow schemas cost idle CPU and fail their own
requests, and no other client's compile waits behind them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvscale.server.structured_outputs.thread_priority import lower_this_thread

logger = logging.getLogger(__name__)

# Below this share of a CPU per worker (while they have work) the pool counts as starved. A
# SCHED_IDLE worker on an idle 2-vCPU Xeon gets ~100 %; beside two CPU hogs at a normal priority
# ~1 %, whatever the engine does.
STARVED_SHARE = 0.05
# How often the rescuer reads the workers' clocks.
RESCUE_POLL_S = 0.05
# Threads finishing abandoned compiles beside the workers; past it an over-limit compile keeps its
# worker (its requests fail all the same).
MAX_ABANDONED = 4


@dataclass
class Compiled:
    template: Any  # the library's pristine matcher
    seconds: float  # wall-clock time from the first thread picking it up to done (0 for a cache hit)
    cpu_seconds: float = 0.0  # CPU time of the thread whose copy finished, what the time limit counts


def thread_cpu_clock() -> int | None:
    """The calling thread's CPU-time clock, readable from any thread (None where the OS has none)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def read_clock(clock: int) -> float | None:
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread has ended
        return None


class CompileJob:
    """One compile: its argument, its future, and the threads running it."""

    def __init__(self, arg: Any) -> None:
        self.arg = arg
        self.future: Future[Compiled] = Future()
        self.submitted = time.monotonic()
        self.started: float | None = None  # monotonic, when the first thread picked it up
        # (CPU clock, its reading at the start) per thread compiling it; the clock None: the
        # OS has none, and the reading is the monotonic start (wall time stands in).
        self.runs: list[tuple[int | None, float]] = []
        self.abandoned = False  # over the time limit: its thread ends once it is done

    def cpu_seconds(self, now: float) -> float | None:
        """The most CPU time any thread has spent on this job so far; None before it starts.
        Read it before looking at the future: a thread settles the future (or finds it settled)
        before it takes another job, so a reading taken while the future was not yet done is
        this job's own."""
        spent = None
        for clock, at in list(self.runs):
            reading = now if clock is None else read_clock(clock)
            if reading is not None:
                spent = max(spent or 0.0, reading - at)
        return spent


class CompilePool:
    def __init__(self, prepare: Callable[[], Any], compile_fn: Callable[[Any, Any], Any], workers: int,
                 priority: str, starved_after_s: float) -> None:
        """``compile_fn(prepare(), arg)`` compiles; ``prepare`` (the tokenizer) runs once, on the
        first job, in a thread at this thread's priority (the module's docstring), and before a
        job's clocks start, so no job is charged for it."""
        self._prepare = prepare
        self._prepared: Future[Any] = Future()
        self._submitted = False
        self._compile_fn = compile_fn
        self._priority = priority
        self._starved_after_s = starved_after_s
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[CompileJob] = deque()
        self._running: list[CompileJob] = []  # taken by a worker, not yet settled
        self._clocks: list[int] = []  # the workers' CPU clocks
        self._closed = False
        self._abandoned = 0  # threads still finishing an abandoned job
        self._forward_ended_at = float("-inf")  # monotonic, the last forward pass's end
        self._forward_running = False
        self.rescues = 0
        self.threads = [threading.Thread(target=self._work_loop, name=f"grammar-compile-{i}", daemon=True)
                        for i in range(workers)]
        self.threads.append(threading.Thread(target=self._prepare_once, name="grammar-compile-prepare",
                                             daemon=True))
        if priority != "normal":
            self.threads.append(threading.Thread(target=self._rescue_loop, name="grammar-compile-rescue",
                                                 daemon=True))
        for thread in self.threads:
            thread.start()

    def submit(self, arg: Any) -> CompileJob:
        job = CompileJob(arg)
        with self._work:
            self._submitted = True
            self._queue.append(job)
            self._work.notify_all()
        return job

    @contextmanager
    def forward_running(self) -> Iterator[None]:
        """The engine runs a forward pass inside this block: starved workers are then waiting for
        the engine, as they should, and the rescuer leaves them be, however long the pass (a long
        prefill chunk can outlast ``starved_after_s``)."""
        self._forward_running = True
        try:
            yield
        finally:
            # The end first: the rescuer reads the two without a lock, and must never see the pass
            # over with an older end.
            self._forward_ended_at = time.monotonic()
            self._forward_running = False

    def abandon(self, job: CompileJob) -> bool:
        """Give up on a running ``job`` (over the time limit): a new worker takes the queue; the
        job's thread finishes it, then ends. False when it is not running on a worker, is done,
        or ``MAX_ABANDONED`` threads are already finishing such jobs."""
        with self._work:
            if (self._closed or job.abandoned or job.future.done() or job not in self._running
                    or self._abandoned >= MAX_ABANDONED):
                return False
            job.abandoned = True
            self._abandoned += 1
            worker = threading.Thread(target=self._work_loop, name="grammar-compile-replacement", daemon=True)
            self.threads = [thread for thread in self.threads if thread.is_alive()] + [worker]
        logger.warning("a grammar compile ran past its CPU-time limit: a new worker takes the queue "
                       "while it finishes (%d such)", self._abandoned)
        worker.start()
        return True

    def shutdown(self) -> None:
        # A build already running finishes (cancel fails); one not begun never will.
        self._prepared.cancel()
        with self._work:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._work.notify_all()

    # --- the threads ----------------------------------------------------------------------
    def _prepare_once(self) -> None:
        """Build what every compile needs, at the pool creator's priority, once a job is submitted:
        a pool that never compiles never builds it."""
        with self._work:
            self._work.wait_for(lambda: self._closed or self._submitted)
        if not self._prepared.set_running_or_notify_cancel():
            return
        try:
            self._prepared.set_result(self._prepare())
        except BaseException as exc:  # noqa: BLE001 - every job fails with it
            self._prepared.set_exception(exc)

    def _work_loop(self) -> None:
        lower_this_thread(self._priority)
        clock = thread_cpu_clock()
        with self._work:
            if clock is not None:
                self._clocks.append(clock)
        while True:
            with self._work:
                self._work.wait_for(lambda: self._closed or bool(self._queue))
                if self._closed:
                    return
                job = self._queue.popleft()
                self._running.append(job)
            self._run(job)
            with self._work:
                self._running.remove(job)
                self._work.notify_all()
                if job.abandoned:  # a replacement took this thread's place
                    self._abandoned -= 1
                    if clock is not None:
                        self._clocks.remove(clock)
                    return

    def _rescue_loop(self) -> None:
        mark: tuple[float, float] | None = None  # (when, the workers' CPU time then) while busy
        while True:
            with self._work:
                # Work queued counts as well as work running: a starved worker may not even get
                # the CPU to take a job up.
                if not (self._running or self._queue):
                    mark = None
                    self._work.wait_for(lambda: self._closed or bool(self._running or self._queue))
                if self._closed:
                    return
                clocks = list(self._clocks)
            now, cpu = time.monotonic(), self._workers_cpu(clocks)
            if mark is None:
                mark = (now, cpu)
            elif now - mark[0] >= self._starved_after_s:
                share = (cpu - mark[1]) / (now - mark[0]) / max(1, len(clocks))
                since = mark[0]
                # Workers waiting for the build (``_prepare_once``) wait for no CPU: a rescue would
                # only wait beside them.
                if share < STARVED_SHARE and self._prepared.done() and self._engine_idle_since(since):
                    # Starved by something other than the engine: compile here, one job after
                    # another, until none is left or the engine runs again.
                    while self._engine_idle_since(since) and self._rescue_one(share):
                        pass
                    mark = None
                else:
                    mark = (now, cpu)
            time.sleep(RESCUE_POLL_S)

    def _engine_idle_since(self, since: float) -> bool:
        return not self._forward_running and self._forward_ended_at < since

    @staticmethod
    def _workers_cpu(clocks: list[int]) -> float:
        return sum(reading for reading in map(read_clock, clocks) if reading is not None)

    def _rescue_one(self, share: float) -> bool:
        """Compile the oldest unfinished job at this thread's (the process's) priority; False
        when there is none (or the pool was shut down)."""
        with self._work:
            unfinished = [job for job in (*self._running, *self._queue)
                          if not job.future.done() and not job.abandoned]
            if self._closed or not unfinished:
                return False
            job = min(unfinished, key=lambda j: j.submitted)
            if job in self._queue:
                self._queue.remove(job)
            self.rescues += 1
        logger.info("grammar compile workers starved (%.1f %% of a CPU for %g s) while the engine is idle: "
                    "compiling at the engine's priority", 100 * share, self._starved_after_s)
        self._run(job)
        return True

    def _run(self, job: CompileJob) -> None:
        if job.future.done():  # the rescuer or a worker got there first
            return
        try:
            prepared = self._prepared.result()
            clock = thread_cpu_clock()
            # time.thread_time() reads this same clock (the calling thread's CPU time).
            started, cpu_started = time.monotonic(), time.thread_time()
            if job.started is None:
                job.started = started
            job.runs.append((clock, cpu_started if clock is not None else started))
            template = self._compile_fn(prepared, job.arg)
            self._settle(job, Compiled(template, time.monotonic() - job.started,
                                       time.thread_time() - cpu_started))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting requests
            self._settle(job, exc)

    def _settle(self, job: CompileJob, outcome: Compiled | BaseException) -> None:
        with self._lock:
            if job.future.done():
                return
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)
