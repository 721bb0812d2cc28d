"""The step a more urgent prefill runs in without the less urgent rows, under ``--scheduling-policy
priority``: the level (pure), and the scheduler on a real block pool without a model (the steps
simulated as test_scheduler.py does)."""

from __future__ import annotations

from scheduler_helpers import apply_step, make_seq

from kvscale.server.core.block_pool import BlockPool
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.scheduler import Scheduler, SchedulerOutput
from kvscale.server.core.urgent_prefill import MAX_SKIPPED_STEPS, skips, urgent_level

BS = 4
LOW, URGENT = 10, 0


def test_a_waiting_prefill_more_urgent_than_a_running_sequence_sets_the_level():
    assert urgent_level([(LOW, False, 0), (LOW, False, 0)], [URGENT, LOW]) == URGENT
    # A running prefill counts as pending (a prompt chunked over several steps).
    assert urgent_level([(URGENT, True, 0), (LOW, False, 0)], []) == URGENT
    # More urgent running sequences do not skip: the level is still set for the less urgent.
    assert urgent_level([(-5, False, 0), (LOW, False, 0)], [URGENT]) == URGENT


def test_no_level_without_a_strictly_less_urgent_sequence():
    assert urgent_level([], [URGENT]) is None
    assert urgent_level([(LOW, False, 0)], []) is None  # nothing pending
    assert urgent_level([(LOW, False, 0)], [LOW]) is None  # equal priorities never skip
    assert urgent_level([(URGENT, False, 0)], [URGENT, URGENT]) is None


def test_a_less_urgent_waiting_sequence_sets_the_level_too():
    # Nothing less urgent runs (the running requests ended together), but a less urgent one waits:
    # admitted beside the urgent prefill, its prefill would lengthen that step.
    assert urgent_level([], [URGENT, LOW]) == URGENT
    assert urgent_level([(URGENT, False, 0)], [URGENT, LOW]) == URGENT
    assert urgent_level([(URGENT, False, 0), (URGENT, True, 0)], [LOW]) == URGENT
    # Held that many steps in a row already: this step admits them.
    assert urgent_level([], [URGENT, LOW], MAX_SKIPPED_STEPS - 1) == URGENT
    assert urgent_level([], [URGENT, LOW], MAX_SKIPPED_STEPS) is None
    # The count is the waiting ones': it does not stop a level only running ones skip for.
    assert urgent_level([(LOW, False, 0)], [URGENT], MAX_SKIPPED_STEPS) == URGENT


def test_no_level_once_a_sequence_that_would_skip_has_skipped_enough_steps():
    running = [(LOW, False, MAX_SKIPPED_STEPS - 1), (5, False, 0)]
    assert urgent_level(running, [URGENT]) == URGENT
    running[0] = (LOW, False, MAX_SKIPPED_STEPS)
    assert urgent_level(running, [URGENT]) is None
    # One that would not skip at this level does not count.
    assert urgent_level([(URGENT, False, MAX_SKIPPED_STEPS), (LOW, False, 0)], [URGENT]) == URGENT


def test_skips_only_the_strictly_less_urgent():
    assert skips(LOW, URGENT) and not skips(URGENT, URGENT) and not skips(-1, URGENT)
    assert not skips(LOW, None)


def advance(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a step: KV computed, a token appended where sampled, ends."""
    apply_step(scheduler, scheduler.kv, out)


def names(out: SchedulerOutput) -> list[str]:
    return [item.seq.request.request_id for item in out.scheduled]


def decoding_lows(policy: str, budget: int = 64, slots: int = 4, **kwargs: int) -> Scheduler:
    """Three low-priority requests past their prefill, decoding; a slot left."""
    kv = KVCacheManager(BlockPool(64, BS, False), False)
    scheduler = Scheduler(kv, slots, budget, policy=policy, **kwargs)
    for name in ("low-a", "low-b", "low-c"):
        scheduler.add(make_seq(name, 8, LOW, max_tokens=30))
    advance(scheduler, scheduler.schedule())
    return scheduler


def test_an_urgent_arrival_prefills_in_a_step_of_its_own():
    scheduler = decoding_lows("priority")
    scheduler.add(make_seq("urgent", 8, URGENT))
    scheduler.add(make_seq("low-d", 8, LOW))  # a less urgent newcomer is not admitted into it
    out = scheduler.schedule()
    assert names(out) == ["urgent"] and out.preempted == []
    assert [seq.skipped_steps for seq in scheduler.running] == [1, 1, 1, 0]
    advance(scheduler, out)
    # Its prefill done, the lows decode beside its decode, and they were not preempted.
    assert names(scheduler.schedule()) == ["urgent", "low-a", "low-b", "low-c"]


def test_an_urgent_arrival_prefills_alone_when_the_running_requests_ended_together():
    # Every running request ended in the same step, freeing every slot: the urgent prefill is
    # admitted, and the less urgent ones waiting beside it are admitted the step after.
    kv = KVCacheManager(BlockPool(64, BS, False), False)
    scheduler = Scheduler(kv, 4, 64, policy="priority")
    for name in ("low-a", "low-b", "low-c"):
        scheduler.add(make_seq(name, 8, LOW))
    scheduler.add(make_seq("urgent", 8, URGENT))
    out = scheduler.schedule()
    assert names(out) == ["urgent"]
    assert scheduler.waiting_held_steps == 1
    advance(scheduler, out)
    assert names(scheduler.schedule()) == ["urgent", "low-a", "low-b", "low-c"]
    assert scheduler.waiting_held_steps == 0


def test_waiting_ones_are_admitted_once_in_every_max_skipped_steps_plus_one_under_a_stream_of_urgent_ones():
    kv = KVCacheManager(BlockPool(64, BS, False), False)
    scheduler = Scheduler(kv, 8, 64, policy="priority")
    scheduler.add(make_seq("low-a", 8, LOW, max_tokens=30))
    admitted_at = None
    for step in range(2 * (MAX_SKIPPED_STEPS + 1)):
        scheduler.add(make_seq(f"urgent-{step}", 8, URGENT, max_tokens=1))
        out = scheduler.schedule()
        if "low-a" in names(out):
            admitted_at = step
            break
        advance(scheduler, out)
    assert admitted_at == MAX_SKIPPED_STEPS


def test_under_fcfs_or_at_one_level_the_step_holds_everyone():
    scheduler = decoding_lows("fcfs")
    scheduler.add(make_seq("urgent", 8, URGENT))
    assert names(scheduler.schedule()) == ["low-a", "low-b", "low-c", "urgent"]
    scheduler = decoding_lows("priority")
    scheduler.add(make_seq("same", 8, LOW))
    assert names(scheduler.schedule()) == ["low-a", "low-b", "low-c", "same"]


def test_a_prompt_chunked_over_steps_keeps_them_out_until_its_last_chunk():
    # A 40-token urgent prompt, a budget of 16: chunks of 16, 16 and 8. The last leaves budget
    # that the lows' decodes would take without the rule.
    scheduler = decoding_lows("priority", budget=16)
    scheduler.add(make_seq("urgent", 40, URGENT))
    steps = []
    for _ in range(4):
        out = scheduler.schedule()
        steps.append(names(out))
        advance(scheduler, out)
    assert steps == [["urgent"]] * 3 + [["urgent", "low-a", "low-b", "low-c"]]


def test_the_lows_decode_once_in_every_max_skipped_steps_plus_one_under_a_stream_of_urgent_ones():
    scheduler = decoding_lows("priority", budget=64, slots=8)
    ran: list[int] = []
    for step in range(3 * (MAX_SKIPPED_STEPS + 1)):
        scheduler.add(make_seq(f"urgent-{step}", 8, URGENT, max_tokens=1))
        out = scheduler.schedule()
        if "low-a" in names(out):
            ran.append(step)
        advance(scheduler, out)
    assert ran == [MAX_SKIPPED_STEPS, 2 * MAX_SKIPPED_STEPS + 1, 3 * MAX_SKIPPED_STEPS + 2]


def test_an_urgent_arrival_that_cannot_be_admitted_skips_nobody():
    # Every LoRA slot serves a low's adapter: the urgent request of another adapter waits for a
    # slot (admission passes it over), and the lows run, or it would wait forever.
    scheduler = decoding_lows("priority", max_loras=1)
    for seq in scheduler.running:
        seq.request.lora_name = "low-adapter"
    urgent = make_seq("urgent", 8, URGENT)
    urgent.request.lora_name = "urgent-adapter"
    scheduler.add(urgent)
    assert names(scheduler.schedule()) == ["low-a", "low-b", "low-c"]
    assert [seq.skipped_steps for seq in scheduler.running] == [0, 0, 0]
