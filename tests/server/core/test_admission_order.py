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
