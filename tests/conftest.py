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
