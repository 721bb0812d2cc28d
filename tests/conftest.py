"""Session-wide fixtures shared by every test folder.

`k8s_env` is one real control plane per test session (etcd, kube-apiserver, controller-manager,
scheduler, kwok with a fake GPU node), started from the binaries tools/k8s-bins.sh builds or
finds; the operator tests and the router's EndpointSlice discovery tests share it. Anything
missing is an error, never a skip.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

# The session-scoped services that are costly to start, in the order a file using several is
# grouped by. Under pytest-xdist every file using one runs on the same worker, so each starts once.
SHARED_SESSION_FIXTURES = ("process_cluster", "k8s_env", "replicas")


@functools.cache
def scope_of_file(path: str) -> str:
    """The unit pytest-xdist hands one worker: the first shared session fixture the file's tests
    or fixtures take as an argument, else the file itself (its module fixtures start once)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return path
    taken = {arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
             and (node.name.startswith("test") or "fixture" in ast.dump(ast.Module(node.decorator_list, [])))
             for arg in node.args.args}
    return next((f"shared:{name}" for name in SHARED_SESSION_FIXTURES if name in taken), path)


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the workers share the machine's cores: one OpenMP thread per engine
    # process (the workers' and the servers they start), else their spinning threads fight.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    # xdist's own groups (--dist loadgroup) do not group under pytest 9.2: its worker renames
    # each test's node id, which no longer reaches the controller.
    from xdist.scheduler import LoadScopeScheduling

    class BySharedFixture(LoadScopeScheduling):
        started = False

        def _split_scope(self, nodeid: str) -> str:
            return scope_of_file(str(config.rootpath / nodeid.split("::", 1)[0]))

        def _assign_work_unit(self, node: Any) -> None:
            # The groups on a shared service are the longest units: handed out first, one to each
            # worker, so no worker is left running one alone at the end.
            if not self.started:
                self.started = True
                for name in reversed(SHARED_SESSION_FIXTURES):
                    if f"shared:{name}" in self.workqueue:
                        self.workqueue.move_to_end(f"shared:{name}", last=False)
            super()._assign_work_unit(node)

    return BySharedFixture(config, log)


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
