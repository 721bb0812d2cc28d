"""Under ``--scheduling-policy priority``, a step's forward pass given up between two decoder
layers when a more urgent request arrives while it runs.

Preemption on arrival and the urgent prefill's own step (arrival_preemption.py, urgent_prefill.py)
start a more urgent request at the next step; it still waits for the step in flight, which on a
CPU is the whole batch's forward: under a flood of less urgent requests, half of a high-priority
request's time to first token (docs/engine.md, "Priority scheduling"). The forward's layers are
the only place that wait can be cut: the step is given up at the next layer boundary, taken back
(step_undo.py: nothing it computed is kept, nothing it registered stays findable) and the next
step, the urgent prefill's, starts at once. The less urgent rows run again a step later; the
cost is the layers the given-up step had run.

Decisions, as pure functions: a step can be given up only for an arrival strictly more urgent
than its least urgent row (``interrupts``), and not at all once a row of it has lost
``MAX_SKIPPED_STEPS`` steps in a row (``interrupt_bound``; a given-up step counts as one lost, as
a skipped one does), so a stream of urgent arrivals cannot starve the less urgent ones.

``StepInterrupt`` is the flag between the engine core's input thread, which hears the arrival,
and the forward, which checks it at each layer. Each armed step has its own generation, so an
arrival heard as one step ends never gives up the next one (which may already carry it). An
arrival heard after the loop took its inbox but before the step was armed (while it was being
scheduled: on a short step, a large share of its time) gives that step up too, at once: the
input thread queues a request and notes its priority under ``lock``, and the loop drains its
inbox and clears the notes (``taken``) under it, so a noted arrival is one the step in flight
does not carry.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvscale.server.core.urgent_prefill import MAX_SKIPPED_STEPS


class StepInterrupted(Exception):
    """Raised at a layer boundary of a forward whose step was given up."""


def interrupt_bound(rows: Iterable[tuple[int, int]]) -> int | None:
    """The least urgent priority among a step's rows, (priority, steps skipped in a row) each:
    an arrival of a smaller value may give the step up. None when it may not: no row, or a row
    that has already lost ``MAX_SKIPPED_STEPS`` steps in a row."""
    bound: int | None = None
    for priority, skipped in rows:
        if skipped >= MAX_SKIPPED_STEPS:
            return None
        if bound is None or priority > bound:
            bound = priority
    return bound


def interrupts(arrival_priority: int, bound: int | None) -> bool:
    """Whether an arrival of ``arrival_priority`` gives up the step in flight (``bound`` its
    interrupt_bound; None: not interruptible). Equal priorities never do."""
    return bound is not None and arrival_priority < bound


class StepInterrupt:
    """The flag one step's forward checks between its layers. The engine arms it around a
    forward that may be given up; the core's input thread calls ``on_arrival``. Reads and writes
    of single attributes are atomic under the GIL, and a forward releases the GIL in every
    kernel, so the check sees an arrival within a layer."""

    def __init__(self) -> None:
        self._armed: tuple[int, int] | None = None  # (generation, bound) of the step in flight
        self._generation = 0
        self._given_up = -1  # the generation an arrival gave up
        self._unseen: int | None = None  # the most urgent priority queued since the loop's last take
        self.lock = threading.Lock()  # a queued request and its note; the loop's take and ``taken``
        self.num_interrupted = 0  # steps given up (a metric)

    def arm(self, bound: int) -> None:
        """A forward that may be given up starts; given up at once for an arrival it does not carry."""
        self._generation += 1
        self._armed = (self._generation, bound)
        unseen = self._unseen  # read after arming: an arrival noted since sees the armed step itself
        if unseen is not None and interrupts(unseen, bound):
            self._given_up = self._generation

    def disarm(self) -> None:
        self._armed = None

    def on_arrival(self, priority: int) -> None:
        """A request of ``priority`` was queued for the engine (its input thread, holding ``lock``)."""
        unseen = self._unseen
        self._unseen = priority if unseen is None else min(unseen, priority)
        armed = self._armed  # one read: the generation and bound belong together
        if armed is not None and interrupts(priority, armed[1]):
            self._given_up = armed[0]

    def taken(self) -> None:
        """The loop took every request queued so far (holding ``lock``): none is unseen."""
        self._unseen = None

    def check(self, *_: object) -> None:
        """Raise StepInterrupted where an arrival gave up the armed step (a forward pre-hook:
        PyTorch passes the module and its inputs, ignored)."""
        armed = self._armed
        if armed is not None and self._given_up == armed[0]:
            self._armed = None
            self.num_interrupted += 1
            raise StepInterrupted()
