"""admission_order: the order waiting sequences are tried in, fair across tenants, then across
HTTP requests."""

from __future__ import annotations

from kvscale.server.core.admission_order import admission_order


def test_one_sequence_per_group_is_first_come_first_served():
    assert list(admission_order(["a", "b", "c"])) == [0, 1, 2]


def test_groups_take_turns_ordered_by_their_oldest_sequence():
    # A many-prompt request "bomb" arrived first, then "x", then "y" (two prompts).
    groups = ["bomb", "bomb", "bomb", "x", "bomb", "y", "y"]
    assert list(admission_order(groups)) == [0, 3, 5, 1, 6, 2, 4]


def test_the_preempted_at_the_front_go_first_as_they_are():
    groups = ["bomb", "bomb", "bomb", "x"]
    assert list(admission_order(groups, num_resuming=2)) == [0, 1, 2, 3]
    assert list(admission_order(["x", "bomb", "bomb", "y"], num_resuming=1)) == [0, 1, 3, 2]


def test_every_index_once_and_lazily():
    groups = [i % 3 for i in range(3000)] + ["late"]
    order = admission_order(groups)
    assert [next(order) for _ in range(4)] == [0, 1, 2, 3000]
    assert sorted([0, 1, 2, 3000, *order]) == list(range(3001))
    assert list(admission_order([])) == []


def test_tenants_take_turns_before_their_requests_do():
    # Tenant "heavy" sent three single-prompt requests and a two-prompt one before "light"'s one.
    groups = ["h1", "h2", "h3", "h4", "h4", "l1"]
    tenants = ["heavy", "heavy", "heavy", "heavy", "heavy", "light"]
    assert list(admission_order(groups, tenants=tenants)) == [0, 5, 1, 2, 3, 4]
    # Without tenants, "light" waits behind every heavy request that came first.
    assert list(admission_order(groups)) == [0, 1, 2, 3, 5, 4]


def test_within_a_tenant_its_requests_take_turns():
    groups = ["bomb", "bomb", "bomb", "x", "l"]
    tenants = ["a", "a", "a", "a", "b"]
    assert list(admission_order(groups, tenants=tenants)) == [0, 4, 3, 1, 2]


def test_one_tenant_is_the_groups_order_and_the_preempted_still_go_first():
    groups = ["bomb", "bomb", "bomb", "x", "bomb", "y", "y"]
    assert list(admission_order(groups, tenants=[""] * 7)) == list(admission_order(groups))
    tenants = ["a", "a", "a", "a", "b"]
    assert list(admission_order(["p", "p", "q", "q", "r"], 2, tenants)) == [0, 1, 2, 4, 3]


def test_tenants_every_index_once_and_lazily():
    groups = list(range(3000)) + ["late"]
    tenants = ["flood"] * 3000 + ["quiet"]
    order = admission_order(groups, tenants=tenants)
    assert [next(order) for _ in range(3)] == [0, 3000, 1]
    assert sorted([0, 3000, 1, *order]) == list(range(3001))
    assert list(admission_order([], tenants=[])) == []


def test_the_tenant_holding_fewest_running_goes_first():
    groups = ["h1", "h2", "l1", "l2"]
    tenants = ["heavy", "heavy", "light", "light"]
    # "heavy" has three running: "light" takes the next three slots before "heavy" gets one.
    assert list(admission_order(groups, tenants=tenants, running={"heavy": 3})) == [2, 3, 0, 1]
    assert list(admission_order(groups, tenants=tenants, running={"heavy": 1})) == [2, 0, 3, 1]
    # Running counts of tenants with nothing waiting change nothing.
    assert list(admission_order(groups, tenants=tenants, running={"other": 9})) == [0, 2, 1, 3]


def _steps_to_serve_the_bomb(bomb: int, slots: int, arrivals_per_step: int) -> int:
    """Steps until a many-prompt request queued first is served, each step admitting ``slots``
    one-step sequences in admission_order while ``arrivals_per_step`` single-prompt requests
    join the queue (the scheduler's pass, one tenant, as the hostile soak's replicas see it)."""
    waiting = [("bomb", "")] * bomb
    step = arrival = 0
    while any(group == "bomb" for group, _ in waiting) and step < 1000:  # starved: 1000
        step += 1
        waiting += [(f"honest-{arrival + i}", "") for i in range(arrivals_per_step)]
        arrival += arrivals_per_step
        order = admission_order([g for g, _ in waiting], 0, [t for _, t in waiting], {})
        taken = {next(order) for _ in range(min(slots, len(waiting)))}
        waiting = [seq for index, seq in enumerate(waiting) if index not in taken]
    return step


def test_a_many_prompt_request_is_never_starved_by_later_arrivals():
    # Its group is the oldest, so it has the first turn of every pass: the slots later requests
    # leave are its own, and even when arrivals outnumber the slots it gets one each step
    # (docs/engine.md, "A step"). 16 slots, the soak's --max-num-seqs:
    assert _steps_to_serve_the_bomb(128, 16, 0) == 8
    assert _steps_to_serve_the_bomb(128, 16, 4) == 128 // 12 + 1  # 12 of 16 slots a step
    assert _steps_to_serve_the_bomb(24, 16, 20) == 24  # overloaded: still one slot a step
