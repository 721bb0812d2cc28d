"""``--scheduling-policy priority``: the admission order and the preemption victim (pure), and the
scheduler on a real block pool without a model (the steps simulated as test_scheduler.py does)."""

from __future__ import annotations

import pytest
from scheduler_helpers import apply_step, make_seq

from kvscale.server.core.block_pool import BlockPool
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.priority_order import preemption_victim, priority_admission_order
from kvscale.server.core.scheduler import Scheduler
from kvscale.server.core.sequence import Sequence

BS = 4


def test_levels_go_lowest_value_first_in_arrival_order_within_one():
    assert list(priority_admission_order([5, 0, 5, -1, 0], list("abcde"))) == [3, 1, 4, 0, 2]


def test_one_level_is_the_fcfs_order():
    # Groups round-robin and the preempted first, exactly as admission_order.
    assert list(priority_admission_order([2, 2, 2, 2], ["x", "x", "y", "z"], num_resuming=1)) == [0, 1, 2, 3]
    assert list(priority_admission_order([0, 0, 0], ["g", "g", "h"])) == [0, 2, 1]


def test_a_preempted_sequence_waits_behind_a_more_urgent_newcomer():
    # Index 0 was preempted (front of the queue) at priority 1; index 1 arrived later at 0.
    assert list(priority_admission_order([1, 0], ["a", "b"], num_resuming=1)) == [1, 0]
    # At the same level the preempted one goes first.
    assert list(priority_admission_order([0, 0, 1], ["a", "b", "c"], num_resuming=1)) == [0, 1, 2]


def test_within_a_level_tenants_share_and_groups_round_robin():
    order = priority_admission_order([0, 0, 0, 1], ["g1", "g1", "g2", "g3"],
                                     tenants=["t1", "t1", "t2", "t1"], running={"t1": 1})
    assert list(order) == [2, 0, 1, 3]


def test_the_victim_is_the_largest_priority_then_the_latest_arrival():
    assert preemption_victim([(0, 1), (3, 2), (1, 3)]) == 1
    assert preemption_victim([(1, 1), (1, 5), (0, 9)]) == 1
    assert preemption_victim([(0, 4)]) == 0
    with pytest.raises(ValueError):
        preemption_victim([])


def run(scheduler: Scheduler, kv: KVCacheManager, late: Sequence | None = None,
        steps: int = 100, late_at: int = 1) -> tuple[list[str], list[str]]:
    """Simulated steps until all finish (``late`` added before step ``late_at``); returns the names
    in the order they were first scheduled (again, after a preemption) and the preempted ones."""
    admitted: list[str] = []
    preempted: list[str] = []
    for step in range(steps):
        if step == late_at and late is not None:
            scheduler.add(late)
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        preempted += [seq.request.request_id for seq in out.preempted]
        admitted += [item.seq.request.request_id for item in out.scheduled if item.seq.num_computed_tokens == 0]
        apply_step(scheduler, kv, out)
    assert not scheduler.has_unfinished()
    return admitted, preempted


def scarce(policy: str) -> tuple[list[str], list[str]]:
    """6 blocks of 4: two 8-token prompts (priorities 5 and 1) take two each and grow into a
    fourth each; an urgent one (0) arrives once both run (under priority the more urgent one
    prefills a step ahead: urgent_prefill.py) and finds no room."""
    kv = KVCacheManager(BlockPool(6, BS, False), False)
    scheduler = Scheduler(kv, 8, 64, policy=policy)
    scheduler.add(make_seq("low", 8, 5, max_tokens=8))
    scheduler.add(make_seq("mid", 8, 1, max_tokens=12))
    return run(scheduler, kv, late=make_seq("urgent", 8, 0, max_tokens=8), late_at=2)


def test_priority_preempts_the_least_urgent_and_admits_the_most_urgent_first():
    admitted, preempted = scarce("priority")
    # The more urgent first; the low one gives its blocks back, and the urgent newcomer takes
    # them before the low one comes back.
    assert admitted == ["mid", "low", "urgent", "mid", "low"]
    assert preempted == ["low", "mid"]  # then mid, for the urgent one's growth


def test_fcfs_preempts_the_newest_whatever_the_priority():
    admitted, preempted = scarce("fcfs")
    assert admitted[:2] == ["low", "mid"]
    assert preempted[0] == "mid"


def full_batch(policy: str, late_priority: int) -> tuple[list[str], list[str]]:
    """Two slots, both held by long low-priority requests (5); a third arrives a step later with
    room for its blocks but no slot. Returns the admission and preemption orders."""
    kv = KVCacheManager(BlockPool(64, BS, False), False)
    scheduler = Scheduler(kv, 2, 64, policy=policy)
    for name in ("low-a", "low-b"):
        scheduler.add(make_seq(name, 8, 5, max_tokens=20))
    return run(scheduler, kv, late=make_seq("late", 8, late_priority, max_tokens=4))


def test_a_more_urgent_arrival_takes_a_slot_from_the_least_urgent_running_one():
    admitted, preempted = full_batch("priority", 0)
    # At once, not after low-a or low-b has run its 20 tokens: low-b (the later of the two
    # least urgent) gives its slot back and comes back when the urgent one ends.
    assert admitted == ["low-a", "low-b", "late", "low-b"]
    assert preempted == ["low-b"]


def test_an_equally_urgent_arrival_waits_for_a_slot():
    admitted, preempted = full_batch("priority", 5)
    assert admitted == ["low-a", "low-b", "late"] and preempted == []
    admitted, preempted = full_batch("fcfs", 0)  # fcfs never preempts for a waiting one
    assert admitted == ["low-a", "low-b", "late"] and preempted == []


def test_a_more_urgent_arrival_takes_the_blocks_running_ones_would_grow_into():
    # 8 blocks of 4: two 12-token prompts hold 3 each, and their next tokens need a 4th each.
    kv = KVCacheManager(BlockPool(8, BS, False), False)
    scheduler = Scheduler(kv, 8, 64, policy="priority")
    lows = [make_seq(name, 12, 5, max_tokens=20) for name in ("low-a", "low-b")]
    for seq in lows:
        scheduler.add(seq)
    for item in scheduler.schedule().scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.token_ids.append(7)
    scheduler.add(make_seq("urgent", 8, 0))
    out = scheduler.schedule()
    # Without preemption on arrival both lows would grow into the last two blocks and the
    # urgent one would wait for a running one to give blocks back. (low-a, which kept its
    # blocks, skips the urgent prefill's step: urgent_prefill.py.)
    assert [item.seq.request.request_id for item in out.scheduled] == ["urgent"]
    assert out.preempted == [lows[1]]
    assert scheduler.running == [lows[0], out.scheduled[0].seq] and lows[0].skipped_steps == 1


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority"):
        Scheduler(KVCacheManager(BlockPool(4, BS, False), False), 8, 64, policy="lifo")
