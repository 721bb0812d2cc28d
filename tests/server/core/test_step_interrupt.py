"""A step given up for a more urgent arrival: the decisions (pure), the flag between the input
thread and the forward, and the scheduler taken back to where it was before the step, on a real
block pool without a model (the steps simulated as test_scheduler.py does)."""

from __future__ import annotations

import pytest
from scheduler_helpers import apply_step, make_seq

from kvscale.server.core.block_pool import BlockPool
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.scheduler import Scheduler, SchedulerOutput
from kvscale.server.core.sequence import Sequence, SequenceStatus
from kvscale.server.core.step_interrupt import (
    StepInterrupt,
    StepInterrupted,
    interrupt_bound,
    interrupts,
)
from kvscale.server.core.step_undo import take_snapshot, undo_step, undoable
from kvscale.server.core.urgent_prefill import MAX_SKIPPED_STEPS
from kvscale.server.outputs import BlockRemoved

BS = 4
LOW, URGENT = 10, 0


def test_the_bound_is_the_least_urgent_row_and_only_a_more_urgent_arrival_passes_it():
    assert interrupt_bound([(URGENT, 0), (LOW, 0), (3, 1)]) == LOW
    assert interrupts(URGENT, LOW) and interrupts(LOW - 1, LOW)
    assert not interrupts(LOW, LOW)  # equal priorities never give a step up
    assert not interrupts(LOW + 1, LOW)
    assert not interrupts(URGENT, None)
    assert interrupt_bound([]) is None


def test_no_bound_once_a_row_has_lost_enough_steps_in_a_row():
    assert interrupt_bound([(LOW, MAX_SKIPPED_STEPS - 1)]) == LOW
    assert interrupt_bound([(LOW, 0), (URGENT, MAX_SKIPPED_STEPS)]) is None


def test_the_flag_gives_up_only_the_step_armed_when_the_arrival_came():
    interrupt = StepInterrupt()
    interrupt.arm(LOW)
    interrupt.check()
    interrupt.on_arrival(LOW)  # not more urgent
    interrupt.check()
    interrupt.on_arrival(URGENT)
    with pytest.raises(StepInterrupted):
        interrupt.check()
    interrupt.check()  # raised once: the forward is gone
    assert interrupt.num_interrupted == 1
    interrupt.disarm()
    interrupt.taken()  # the loop took the request: the next step carries it
    # An arrival that read the armed step just before it ended marks that step's generation:
    # the next step (which may carry the request) is not given up for it.
    interrupt.arm(LOW)
    assert interrupt._armed is not None
    generation, _ = interrupt._armed
    interrupt.disarm()
    interrupt.arm(LOW)
    interrupt._given_up = generation
    interrupt.check()
    assert interrupt.num_interrupted == 1


def test_an_arrival_queued_after_the_take_gives_up_the_step_armed_next():
    """Heard while the step was being scheduled (no step armed), after the loop took its inbox:
    the step armed next does not carry it, and is given up before it runs."""
    interrupt = StepInterrupt()
    interrupt.on_arrival(URGENT)
    interrupt.arm(LOW)
    with pytest.raises(StepInterrupted):
        interrupt.check()
    interrupt.disarm()
    interrupt.taken()  # the loop took it: the urgent request is in the next step
    interrupt.arm(LOW)
    interrupt.check()
    # Only one more urgent than the step's least urgent row counts.
    interrupt.disarm()
    interrupt.on_arrival(LOW)
    interrupt.arm(LOW)
    interrupt.check()
    assert interrupt.num_interrupted == 1


def advance(scheduler: Scheduler, out: SchedulerOutput) -> None:
    apply_step(scheduler, scheduler.kv, out)


def state(scheduler: Scheduler) -> tuple:
    """Everything a step could change that taking it back must restore."""
    pool = scheduler.kv.pool

    def seq_state(seq: Sequence) -> tuple:
        return (seq.request.request_id, seq.status, seq.num_computed_tokens, list(seq.block_table),
                seq.num_registered_blocks, seq.preempted)

    return ([seq_state(s) for s in scheduler.running], [seq_state(s) for s in scheduler.waiting],
            pool.num_free_blocks, sorted(pool.cached_hashes()),
            scheduler.kv.prefix_cache_queries, scheduler.kv.prefix_cache_hits)


def seq_of(name: str, tokens: list[int], priority: int, max_tokens: int = 6) -> Sequence:
    seq = make_seq(name, len(tokens), priority, max_tokens)
    seq.token_ids[:] = tokens
    seq.request.prompt_token_ids = list(tokens)
    return seq


def flooded(num_blocks: int = 64) -> Scheduler:
    """Two low-priority requests decoding (14-token prompts sharing their first two blocks), a
    third one's prompt waiting."""
    kv = KVCacheManager(BlockPool(num_blocks, BS, True), True)
    scheduler = Scheduler(kv, 8, 64, policy="priority")
    shared = list(range(1, 9))
    for k, name in enumerate(("low-a", "low-b")):
        scheduler.add(seq_of(name, shared + [100 * (k + 1) + i for i in range(6)], LOW, max_tokens=30))
    advance(scheduler, scheduler.schedule())
    advance(scheduler, scheduler.schedule())
    scheduler.add(seq_of("low-c", list(range(50, 60)), LOW))
    return scheduler


def test_a_step_taken_back_leaves_the_scheduler_as_before_it():
    scheduler = flooded()
    # Decoding, low-a and low-b fill their fourth block this step (14 prompt tokens + 2).
    before = state(scheduler)
    snapshot = take_snapshot(scheduler)
    out = scheduler.schedule()
    assert [item.seq.request.request_id for item in out.scheduled] == ["low-a", "low-b", "low-c"]
    assert undoable(scheduler, out, snapshot, copied=False)
    scheduler.kv.pool.drain_events()
    newly_registered = [seq.block_hashes[i] for seq in (item.seq for item in out.scheduled)
                        for i in range(snapshot.running_states.get(seq.seq_id, (0, 0, 0))[1], seq.num_registered_blocks)]
    assert newly_registered  # the step made blocks findable before computing them
    undo_step(scheduler, out, snapshot)
    assert state(scheduler) == before
    # Nobody finds what the step did not compute; the routers hear the blocks are gone.
    assert all(scheduler.kv.pool.lookup(h) is None for h in newly_registered)
    removed = [h for e in scheduler.kv.pool.drain_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(set(newly_registered) - set(before[3]))
    # Every scheduled sequence counts the step as one lost.
    assert [seq.skipped_steps for seq in (*scheduler.running, *scheduler.waiting)] == [1, 1, 1]


def test_after_a_step_taken_back_the_same_step_runs_and_ends_with_every_block_free():
    scheduler = flooded()
    snapshot = take_snapshot(scheduler)
    undo_step(scheduler, scheduler.schedule(), snapshot)
    scheduler.add(make_seq("urgent", 6, URGENT))
    out = scheduler.schedule()
    # The urgent prefill runs in a step of its own (urgent_prefill.py); the rest come back.
    assert [item.seq.request.request_id for item in out.scheduled] == ["urgent"]
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        advance(scheduler, scheduler.schedule())
    assert not scheduler.has_unfinished()
    assert scheduler.kv.pool.num_active_blocks == 0


def test_a_prefix_hit_on_a_block_the_step_registered_is_taken_back_too():
    kv = KVCacheManager(BlockPool(64, BS, True), True)
    scheduler = Scheduler(kv, 8, 64, policy="priority")
    first = seq_of("low-a", list(range(1, 11)), LOW)
    twin = seq_of("low-b", list(range(1, 11)), LOW)  # the same prompt: b hits a's blocks in the same step
    scheduler.add(first)
    scheduler.add(twin)
    snapshot = take_snapshot(scheduler)
    out = scheduler.schedule()
    assert twin.num_computed_tokens == 8 and twin.block_table[:2] == first.block_table[:2]
    undo_step(scheduler, out, snapshot)
    for seq in (first, twin):
        assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
    assert kv.pool.num_active_blocks == 0 and kv.pool.cached_hashes() == []
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0


def test_a_step_that_preempted_or_copied_cannot_be_taken_back():
    scheduler = flooded(num_blocks=7)  # a and b hold 6 blocks: c's prompt finds no room
    scheduler.add(seq_of("urgent", list(range(70, 80)), URGENT))
    snapshot = take_snapshot(scheduler)
    out = scheduler.schedule()
    assert out.preempted  # the urgent arrival took a low one's blocks
    assert not undoable(scheduler, out, snapshot, copied=False)
    calm = flooded()
    snapshot = take_snapshot(calm)
    out = calm.schedule()
    assert undoable(calm, out, snapshot, copied=False)
    assert not undoable(calm, out, snapshot, copied=True)
