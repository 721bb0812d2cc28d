"""Which CPUs the engine core's OpenMP threads get and which the front end keeps (a pure rule)."""

from __future__ import annotations

import pytest

from kvscale.server.engine.cpu_binding import RESERVE_FROM, core_threads, parse_cpu_list, split_cpus


def test_auto_shares_few_cpus_and_keeps_one_for_the_front_end_from_four_on() -> None:
    assert split_cpus({0}, "auto").core == (0,)
    two = split_cpus({0, 1}, "auto")
    assert two.core == (0, 1) and two.front is None and two.num_threads == 2
    assert RESERVE_FROM == 4
    four = split_cpus({0, 1, 2, 3}, "auto")
    assert four.core == (0, 1, 2) and four.front == (3,)
    many = split_cpus(set(range(8, 40)), "")  # empty means auto
    assert many.core == tuple(range(8, 39)) and many.front == (39,) and "one kept" in many.why


def test_an_explicit_list_gives_the_rest_to_the_front_end() -> None:
    split = split_cpus({0, 1, 2, 3}, "0-2")
    assert split.core == (0, 1, 2) and split.front == (3,)
    everything = split_cpus({0, 1}, "0,1")
    assert everything.core == (0, 1) and everything.front is None


def test_nobind_leaves_affinity_and_threads_alone() -> None:
    split = split_cpus({0, 1, 2, 3}, "nobind")
    assert split.core is None and split.front is None and split.num_threads is None


@pytest.mark.parametrize("spec", ["0-", "a", "2-1", "0,,1", "0,0", "-1"])
def test_bad_lists_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(spec)


def test_cpus_outside_the_allowed_set_are_refused() -> None:
    with pytest.raises(ValueError, match="not among"):
        split_cpus({0, 1}, "1-2")


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)


def test_an_explicit_omp_num_threads_caps_the_core_threads() -> None:
    split = split_cpus({0, 1, 2, 3}, "auto")
    assert core_threads(split, None) == 3
    assert core_threads(split, "1") == 1
    assert core_threads(split, "16") == 3  # never more threads than CPUs it is pinned to
    assert core_threads(split, "junk") == 3
    assert core_threads(split_cpus({0, 1}, "nobind"), "2") == 2
    assert core_threads(split_cpus({0, 1}, "nobind"), None) is None
