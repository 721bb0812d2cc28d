"""Under ``--scheduling-policy priority``, the step a more urgent prefill runs in without the less
urgent rows, as pure functions.

Preemption on arrival (arrival_preemption.py) gives a more urgent request a slot at once, but its
prefill would still share the step with the less urgent running sequences' decodes (and a
newcomer's prefill), and its first token comes at that step's end. Where a step's time grows with
its rows (a CPU, a small batch) that step is as long as the urgent prefill plus all of theirs
(docs/engine.md, "Priority scheduling").

The rule: the urgent level is the smallest priority value among the prefills pending (waiting
sequences, and running ones whose prompt is not computed yet), when some running sequence has a
strictly larger value. Then running sequences of a larger value than the level skip the step
(they keep their slots and blocks, and their KV), and no waiting one of a larger value is
admitted into it, provided a prefill of the level is scheduled; when none is (no room, no LoRA
slot for it, the budget spent) the step is composed as without the rule.

Bounded, so it cannot starve the less urgent ones: a level lasts only while its prefills are
pending (a prompt within the token budget costs the others one step), and a running sequence
skips at most ``MAX_SKIPPED_STEPS`` steps in a row: once one that would skip has, nothing skips.
Equal priorities never skip for each other, so with every request at one level the step is the
fcfs one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# With the default 2,048-token budget, an urgent prompt of up to 8,192 tokens runs alone; a less
# urgent decode then waits at most 5 steps for its next token.
MAX_SKIPPED_STEPS = 4


def urgent_level(running: Sequence[tuple[int, bool, int]], waiting: Iterable[int]) -> int | None:
    """The priority level whose prefills run without less urgent rows this step, or None.

    ``running``: (priority, prompt not yet computed, steps skipped in a row) per running sequence;
    ``waiting``: each waiting sequence's priority. None when no prefill is pending, when no running
    sequence is strictly less urgent than the most urgent pending prefill, or when one that is has
    already skipped ``MAX_SKIPPED_STEPS`` steps in a row."""
    pending = [priority for priority, prefilling, _ in running if prefilling]
    pending.extend(waiting)
    if not pending:
        return None
    level = min(pending)
    skipping = [skipped for priority, _, skipped in running if priority > level]
    if not skipping or max(skipping) >= MAX_SKIPPED_STEPS:
        return None
    return level


def skips(priority: int, level: int | None) -> bool:
    """Whether a sequence of ``priority`` stays out of a step whose urgent level is ``level``."""
    return level is not None and priority > level
