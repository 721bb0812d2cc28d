"""arrival_preemption: when a waiting sequence lacks room, and which running one it may preempt
under ``--scheduling-policy priority`` (the scheduler's use: tests/server/core/test_priority_order.py)."""

from __future__ import annotations

from kvscale.server.core.arrival_preemption import arrival_victim, lacks_room


def test_the_victim_is_the_least_urgent_running_one_when_strictly_less_urgent():
    # (priority, arrival): the largest key, the latest arrival among equal priorities.
    assert arrival_victim(0, [(5, 1), (9, 2), (9, 3), (1, 4)]) == 2
    assert arrival_victim(4, [(5, 1)]) == 0


def test_equal_or_more_urgent_running_ones_are_never_preempted():
    # Equal priorities never preempt each other: a preempted sequence keeps its priority and its
    # earlier arrival, so a key comparison would take the place back at once (thrash).
    assert arrival_victim(5, [(5, 1), (5, 2)]) is None
    assert arrival_victim(3, [(0, 1), (2, 2)]) is None
    assert arrival_victim(0, []) is None


def test_room_lacks_without_a_slot_or_enough_free_blocks():
    assert lacks_room(0, 100, 1)
    assert lacks_room(2, 3, 4)
    assert not lacks_room(1, 4, 4)
