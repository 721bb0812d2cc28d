"""Under ``--scheduling-policy priority``, the step a more urgent prefill runs in without the less
urgent rows, as pure functions.

Preemption on arrival (arrival_preemption.py) gives a more urgent request a slot at once, but its
prefill would still share the step with the less urgent running sequences' decodes (and a
newcomer's prefill), and its first token comes at that step's end. Where a step's time grows with
its rows (a CPU, a small batch) that step is as long as the urgent prefill plus all of theirs
(docs/engine.md, "Priority scheduling").

The rule: the urgent level is the smallest priority value among the prefills pending (waiting
sequences, and running ones whose prompt is not computed yet), when some running or waiting
sequence has a strictly larger value. Then running sequences of a larger value than the level skip
the step (they keep their slots and blocks, and their KV), and no waiting one of a larger value is
admitted into it, provided a prefill of the level is scheduled; when none is (no room, no LoRA
slot for it, the budget spent) the step is composed as without the rule. The waiting ones count
too: when the running requests end together (a batch of equal short requests does), the freed
slots would otherwise take less urgent prefills into the urgent prefill's step, and it would last
as long as all of those prefills together.

Bounded, so it cannot starve the less urgent ones: a level lasts only while its prefills are
pending (a prompt within the token budget costs the others one step), a running sequence skips at
most ``MAX_SKIPPED_STEPS`` steps in a row, and less urgent waiting ones are held out of at most as
many steps in a row (the scheduler counts them): once either bound is reached, nothing skips.
Equal priorities never skip for each other, so with every request at one level the step is the
fcfs one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# With the default 2,048-token budget, an urgent prompt of up to 8,192 tokens runs alone; a less
# urgent decode then waits at most 5 steps for its next token.
MAX_SKIPPED_STEPS = 4


def urgent_level(running: Sequence[tuple[int, bool, int]], waiting: Iterable[int],
                 waiting_held_steps: int = 0) -> int | None:
    """The priority level whose prefills run without less urgent rows this step, or None.

    ``running``: (priority, prompt not yet computed, steps skipped in a row) per running sequence;
    ``waiting``: each waiting sequence's priority; ``waiting_held_steps``: the steps in a row that
    a less urgent waiting sequence was held out of. None when no prefill is pending, when no
    running or waiting sequence is strictly less urgent than the most urgent pending prefill, or
    when the ones that are have been held back ``MAX_SKIPPED_STEPS`` steps in a row (a running one
    that would skip has skipped that many, or waiting ones were held that many)."""
    queued = list(waiting)
    pending = [priority for priority, prefilling, _ in running if prefilling] + queued
    if not pending:
        return None
    level = min(pending)
    skipping = [skipped for priority, _, skipped in running if priority > level]
    held = any(priority > level for priority in queued)
    if not skipping and not held:
        return None
    if max(skipping, default=0) >= MAX_SKIPPED_STEPS or (held and waiting_held_steps >= MAX_SKIPPED_STEPS):
        return None
    return level


def skips(priority: int, level: int | None) -> bool:
    """Whether a sequence of ``priority`` stays out of a step whose urgent level is ``level``."""
    return level is not None and priority > level
