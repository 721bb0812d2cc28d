"""Session-wide fixtures shared by every test folder.

`k8s_env` is one real control plane per test session (etcd, kube-apiserver, controller-manager,
scheduler, kwok with a fake GPU node), started from the binaries tools/k8s-bins.sh builds or
finds; the operator tests and the router's EndpointSlice discovery tests share it. Anything
missing is an error, never a skip.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Test infrastructure in tests/cluster (the control plane, the pod process runtime) is imported by
# module name. Not tests/ itself: its kvscale/ folder would shadow the real package.
sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))
# The benchmark harness (bench/, at the repository root) is imported by its package name, from
# any test folder run alone. Appended, not prepended: nothing at the root may shadow what is installed.
REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:
    sys.path.append(REPO)

from kubelet import KubeletRuntime, start_runtime  # noqa: E402
from testenv import (  # noqa: E402
    CPU_NODE_NAME,
    FAKE_NODE_NAME,
    K8sEnv,
    find_or_build_bins,
    start_env,
    stop_env,
)

# Tests that use one of the session's control planes, and the folders whose tests drive podman or
# start control planes of their own, run in one pytest-xdist worker, in collection order: the
# session starts each control plane once and two image builds never race. Every other test file
# is a group of its own (its module fixtures start once). `make test` runs two workers, so the
# cluster tests, which mostly wait on controllers and pods, overlap the engine tests, which compute.
CLUSTER_FIXTURES = frozenset({"k8s_env", "process_cluster"})
CLUSTER_FOLDERS = ("tests/images/", "tests/cluster/")


# tryfirst: pytest-xdist's worker reads the groups in its own hook of this name, which would
# otherwise run before this one and find none.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        uses_cluster = CLUSTER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        group = "cluster" if uses_cluster or path.startswith(CLUSTER_FOLDERS) else path
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def k8s_bins() -> Path:
    return find_or_build_bins()


@pytest.fixture(scope="session")
def k8s_env(k8s_bins: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sEnv]:
    env = start_env(tmp_path_factory.mktemp("k8s"), k8s_bins)
    try:
        yield env
    finally:
        # Logs stay in pytest's tmp dir (the last few runs are kept) for post-mortems.
        stop_env(env, keep_logs=True)


@dataclass
class ProcessCluster:
    """A control plane whose kwok pods run as real processes (tests/cluster/kubelet.py)."""

    env: K8sEnv
    runtime: KubeletRuntime


@pytest.fixture(scope="session")
def process_cluster(k8s_bins: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    """Its own control plane (kwok plays no pods there), shared by the whole-platform tests."""
    workdir = tmp_path_factory.mktemp("k8s-processes")
    env = start_env(workdir / "env", k8s_bins, process_pods=True)
    runtime = None
    try:
        runtime = start_runtime(env, workdir / "kubelet", (FAKE_NODE_NAME, CPU_NODE_NAME))
        yield ProcessCluster(env, runtime)
    finally:
        if runtime is not None:
            runtime.stop()
        stop_env(env, keep_logs=True)
