"""Preemption on arrival under ``--scheduling-policy priority``, as pure functions: a waiting
sequence more urgent than a running one takes that one's slot or blocks when it lacks them.

Without it, a high-priority request arriving while ``max_num_seqs`` sequences run (or while
their blocks fill the pool) waits until one of them ends; under a flood of low-priority
requests that is the whole length of one of theirs (docs/engine.md, "Priority scheduling").
vLLM v1 preempts by priority only when a *running* request cannot grow; a waiting one stops
admission (docs/engine.md, "Priority scheduling", says what vLLM does and what this costs).

The rule: the victim is the running sequence with the largest (priority, arrival) key
(priority_order.preemption_victim), and only when its priority value is strictly larger than
the waiting one's. Equal priorities never preempt each other, so it cannot thrash: a victim is
less urgent than the sequence taking its place, and a preempted sequence keeps its priority, so
it never takes the place back from the one that preempted it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvscale.server.core.priority_order import preemption_victim


def lacks_room(free_slots: int, free_blocks: int, blocks_needed: int) -> bool:
    """Whether a waiting sequence would not be admitted now: no slot of ``max_num_seqs`` left, or
    fewer blocks free (after the running sequences' growth this step) than it needs."""
    return free_slots < 1 or free_blocks < blocks_needed


def arrival_victim(waiting_priority: int, running_keys: Sequence[tuple[int, int]]) -> int | None:
    """The index of the running sequence a waiting one of ``waiting_priority`` may preempt, or
    None: the largest (priority, arrival) key, only when its priority is strictly larger."""
    if not running_keys:
        return None
    victim = preemption_victim(running_keys)
    return victim if running_keys[victim][0] > waiting_priority else None
