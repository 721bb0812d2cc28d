"""``--scheduling-policy priority`` (vLLM's): the order waiting sequences are admitted in and the
running sequence preempted when KV blocks run out, as pure functions.

A request's priority is an int, lower first (vLLM's convention; 0 is every request's default).
Waiting sequences are tried level by level, the lowest value first; within one level they keep
the first-come-first-served order of admission_order.py (the preempted of that level first, the
tenants' shares, round-robin across HTTP requests), so with every priority equal the order is the
fcfs one. A preempted sequence of a larger value does not go before a waiting one of a smaller:
the newcomer takes the blocks it gave up, which is the point of the policy.

The preemption victim is the running sequence with the largest (priority, arrival) (vLLM v1's
rule), where fcfs preempts the newest: the low-priority ones are the first to give their blocks
back when the running batch grows. A more urgent waiting sequence that lacks a slot or blocks
also preempts (arrival_preemption.py; docs/engine.md, "Priority scheduling").
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence

from kvscale.server.core.admission_order import admission_order


def priority_admission_order(priorities: Sequence[int], groups: Sequence[Hashable],
                             num_resuming: int = 0, tenants: Sequence[str] | None = None,
                             running: Mapping[str, int] | None = None) -> Iterator[int]:
    """Indices into the waiting queue, in the order admission tries them under ``priority``.

    ``priorities``: each waiting sequence's priority, in queue order; the other arguments are
    admission_order's. Each level, the smallest value first, in admission_order's order among the
    level's own sequences (its preempted ones are at the front of the queue, so at the front of
    the level).
    """
    levels: dict[int, list[int]] = {}
    for index, priority in enumerate(priorities):
        levels.setdefault(priority, []).append(index)
    if len(levels) == 1:  # one level: the fcfs order, without the copies
        yield from admission_order(groups, num_resuming, tenants, running)
        return
    for priority in sorted(levels):
        indices = levels[priority]
        level_resuming = sum(1 for index in indices if index < num_resuming)
        level_tenants = [tenants[index] for index in indices] if tenants is not None else None
        for turn in admission_order([groups[index] for index in indices], level_resuming,
                                    level_tenants, running):
            yield indices[turn]


def preemption_victim(keys: Sequence[tuple[int, int]]) -> int:
    """The index of the running sequence to preempt: the largest (priority, arrival) key, the
    last such among equal keys (fcfs would take the last, the newest)."""
    if not keys:
        raise ValueError("no running sequence to preempt")
    victim = 0
    for index in range(1, len(keys)):
        if keys[index] >= keys[victim]:
            victim = index
    return victim
