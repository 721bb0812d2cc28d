"""Which CPUs the engine core's OpenMP threads get and which the front end keeps (a pure rule)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscale.server.engine.cpu_binding import (
    RESERVE_FROM,
    cgroup_cpu_quota,
    core_threads,
    cpu_budget,
    parse_cpu_list,
    quota_from_cfs,
    quota_from_cpu_max,
    split_cpus,
)


def test_auto_shares_few_cpus_and_keeps_one_for_the_front_end_from_four_on() -> None:
    assert split_cpus({0}, "auto", None).core == (0,)
    two = split_cpus({0, 1}, "auto", None)
    assert two.core == (0, 1) and two.front is None and two.num_threads == 2
    assert RESERVE_FROM == 4
    four = split_cpus({0, 1, 2, 3}, "auto", None)
    assert four.core == (0, 1, 2) and four.front == (3,)
    many = split_cpus(set(range(8, 40)), "", None)  # empty means auto
    assert many.core == tuple(range(8, 39)) and many.front == (39,) and "one kept" in many.why


def test_an_explicit_list_gives_the_rest_to_the_front_end() -> None:
    split = split_cpus({0, 1, 2, 3}, "0-2", None)
    assert split.core == (0, 1, 2) and split.front == (3,)
    everything = split_cpus({0, 1}, "0,1", None)
    assert everything.core == (0, 1) and everything.front is None


def test_nobind_leaves_affinity_and_threads_alone() -> None:
    split = split_cpus({0, 1, 2, 3}, "nobind", None)
    assert split.core is None and split.front is None and split.num_threads is None


@pytest.mark.parametrize("spec", ["0-", "a", "2-1", "0,,1", "0,0", "-1"])
def test_bad_lists_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(spec)


def test_cpus_outside_the_allowed_set_are_refused() -> None:
    with pytest.raises(ValueError, match="not among"):
        split_cpus({0, 1}, "1-2", None)


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)


def test_an_explicit_omp_num_threads_caps_the_core_threads() -> None:
    split = split_cpus({0, 1, 2, 3}, "auto", None)
    assert core_threads(split, None) == 3
    assert core_threads(split, "1") == 1
    assert core_threads(split, "16") == 3  # never more threads than CPUs it is pinned to
    assert core_threads(split, "junk") == 3
    assert core_threads(split_cpus({0, 1}, "nobind", None), "2") == 2
    assert core_threads(split_cpus({0, 1}, "nobind", None), None) is None


@pytest.mark.parametrize("text,cpus", [("max 100000", None), ("200000 100000", 2.0),
                                        ("150000 100000\n", 1.5), ("50000 100000", 0.5)])
def test_cgroup_v2_cpu_max(text: str, cpus: float | None) -> None:
    assert quota_from_cpu_max(text) == cpus


def test_cgroup_v1_cfs_quota() -> None:
    assert quota_from_cfs("-1\n", "100000\n") is None
    assert quota_from_cfs("300000", "100000") == 3.0


def fake_cgroup(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "sys-fs-cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(self_cgroup)
    return root, proc


def test_the_tightest_quota_of_a_v2_cgroup_and_its_parents(tmp_path: Path) -> None:
    root, proc = fake_cgroup(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "300000 100000\n",
        "kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 3.0
    # A container in its own cgroup namespace sees its cgroup as the root.
    root, proc = fake_cgroup(tmp_path / "ns", "0::/\n", {"cpu.max": "200000 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 2.0
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent-proc") is None


def test_a_v1_cpu_hierarchy(tmp_path: Path) -> None:
    root, proc = fake_cgroup(tmp_path, "12:memory:/x\n4:cpu,cpuacct:/kubepods/pod2\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(root, proc) == 1.5  # the mount's root: the container's own cgroup


def test_the_budget_takes_omp_num_threads_too(tmp_path: Path) -> None:
    root, proc = fake_cgroup(tmp_path, "0::/\n", {"cpu.max": "400000 100000\n"})
    assert cpu_budget({}, root, proc) == 4.0
    assert cpu_budget({"OMP_NUM_THREADS": "2"}, root, proc) == 2.0
    assert cpu_budget({"OMP_NUM_THREADS": "x"}, tmp_path / "none", tmp_path / "none") is None


def test_a_quota_below_the_mask_sizes_the_threads_and_pins_nothing() -> None:
    # 2 CPUs of a 64-core node: 2 threads, not 63 pinned to CPUs 0-62 as every such pod would.
    split = split_cpus(set(range(64)), "auto", 2.0)
    assert split.core is None and split.front is None and split.num_threads == 2
    assert core_threads(split, None) == 2
    assert split_cpus(set(range(64)), "auto", 1.5).num_threads == 2  # ceil
    assert split_cpus(set(range(64)), "auto", 0.5).num_threads == 1
    # From RESERVE_FROM on, one CPU's worth of the quota is left to the front end.
    assert split_cpus(set(range(64)), "auto", 8.0).num_threads == 7
    # A quota covering the mask: pinned as before.
    covered = split_cpus({0, 1, 2, 3}, "auto", 6.0)
    assert covered.core == (0, 1, 2) and covered.front == (3,)
    # An explicit list stays pinned, with no more threads than the quota keeps busy.
    listed = split_cpus(set(range(8)), "0-5", 2.0)
    assert listed.core == (0, 1, 2, 3, 4, 5) and listed.num_threads == 2
