"""Taking back a scheduled step whose forward was given up (step_interrupt.py), so the scheduler
is as it was before ``schedule()``: the same running and waiting sequences in the same order, the
blocks registered by the step unfindable again, the sequences it admitted waiting without blocks.

Only a step that changed nothing else can be taken back (``undoable``): one that preempted
nothing (a victim's blocks are gone), moved no block between the tiers and copied none (a copy
may have run before the forward), on a pool without a sliding-window group, whose admitted
sequences held no block before. The forward's KV writes need no undoing: a running sequence's
slots are written again, with the same values, by the step that runs it next, and an admitted
sequence's blocks go back to the pool without a hash, so nobody reads them before they are
written again (docs/engine.md, "Priority scheduling").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.server.core.scheduler import Scheduler, SchedulerOutput
from kvscale.server.core.sequence import Sequence, SequenceStatus


@dataclass
class StepSnapshot:
    running: list[Sequence]
    waiting: list[Sequence]
    # A running sequence's (computed tokens, registered blocks, steps skipped in a row).
    running_states: dict[int, tuple[int, int, int]]
    resuming: set[int]  # waiting sequences that were preempted (admission clears the mark)
    holding: set[int]  # waiting sequences holding blocks or computed tokens
    lookups: tuple[int, int, int, int]  # the prefix cache's query and hit counters


def take_snapshot(scheduler: Scheduler) -> StepSnapshot:
    """The scheduler's state before ``schedule()``; starts the pool's log of registrations. A
    waiting sequence (thousands under a flood) costs an attribute test or two, a running one a
    tuple."""
    kv = scheduler.kv
    kv.pool.registration_log = []
    waiting = list(scheduler.waiting)
    return StepSnapshot(
        list(scheduler.running), waiting,
        {seq.seq_id: (seq.num_computed_tokens, seq.num_registered_blocks, seq.skipped_steps)
         for seq in scheduler.running},
        {seq.seq_id for seq in waiting if seq.preempted},
        {seq.seq_id for seq in waiting if seq.block_table or seq.num_computed_tokens},
        (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.host_cache_queries, kv.host_cache_hits))


def undoable(scheduler: Scheduler, out: SchedulerOutput, snapshot: StepSnapshot, copied: bool) -> bool:
    """Whether the step ``out`` can be taken back; ``copied``: blocks were copied for it (between
    the tiers, copy-on-write or the window group's)."""
    if out.preempted or copied or scheduler.kv.window is not None:
        return False
    return not any(item.seq.seq_id in snapshot.holding for item in out.scheduled)


def undo_step(scheduler: Scheduler, out: SchedulerOutput, snapshot: StepSnapshot) -> None:
    """Take the step ``out`` back (``undoable`` said it can be). Every sequence it scheduled
    counts it as a step lost (urgent_prefill.MAX_SKIPPED_STEPS bounds how many in a row)."""
    kv = scheduler.kv
    log, kv.pool.registration_log = kv.pool.registration_log or [], None
    kv.pool.forget_hashes(log)
    for item in out.scheduled:
        seq = item.seq
        state = snapshot.running_states.get(seq.seq_id)
        if state is None:  # admitted by the step: back to waiting, without blocks
            kv.free(seq)
            seq.status = SequenceStatus.WAITING
            seq.preempted = seq.seq_id in snapshot.resuming
            seq.num_computed_tokens = 0
            seq.skipped_steps += 1
        else:
            seq.num_computed_tokens, seq.num_registered_blocks, skipped = state
            seq.skipped_steps = skipped + 1
    scheduler.running[:] = snapshot.running
    scheduler.waiting.clear()
    scheduler.waiting.extend(snapshot.waiting)
    kv.prefix_cache_queries, kv.prefix_cache_hits, kv.host_cache_queries, kv.host_cache_hits = snapshot.lookups
