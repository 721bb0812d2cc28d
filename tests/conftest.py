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
import signal
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


# The units that mostly wait on clocks and hold sub-second bounds (a crashed replica out of every
# router within 1 s): the process cluster's and the control plane's groups, Prometheus, and the
# grammar compile pool's starvation tests (a thread standing in for the engine must run within
# 0.3 s windows while hogs hold the cores).
PROMPT_UNITS = ("shared:process_cluster", "shared:k8s_env")
PROMPT_FOLDERS = ("tests/observability/", "tests/server/structured_outputs/test_structured_outputs_grammar.py")
PROMPT_WORKER = "gw0"
# The other workers' niceness: their compute yields the cores to the prompt worker's wake-ups.
BATCH_NICENESS = 10


def is_prompt_unit(scope: str, rootpath: Path) -> bool:
    """Whether a work unit (scope_of_file's answer) runs on the prompt worker only."""
    if scope in PROMPT_UNITS:
        return True
    relative = Path(scope).relative_to(rootpath).as_posix() if Path(scope).is_absolute() else scope
    return relative.startswith(PROMPT_FOLDERS)


def pytest_configure(config: pytest.Config) -> None:
    # A suite started in the background by a shell without job control inherits SIGINT ignored,
    # and so would every server it starts: SIGINT to one (a terminal's Ctrl-C, what the tests
    # send) would do nothing, or end it without its KeyboardInterrupt exit code. The servers
    # start as a terminal's foreground would start them.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        # Under pytest-xdist the workers share the machine's cores: one OpenMP thread per engine
        # process (the workers' and the servers they start), else their spinning threads fight.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if worker != PROMPT_WORKER:
            os.nice(BATCH_NICENESS)  # inherited by every process this worker starts


def shared_fixture_of(item: pytest.Item) -> str | None:
    """The first costly session service the test takes, directly or through its fixtures."""
    return next((name for name in SHARED_SESSION_FIXTURES if name in getattr(item, "fixturenames", ())), None)


LAST_USERS = pytest.StashKey[dict[str, str]]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every file on one shared service runs next to the others on it, where the first of them
    # stood, so the service stops after the last of them (pytest_runtest_teardown below) instead
    # of idling to the end of the session: an idle control plane still takes a tenth of a core.
    group_of_file: dict[str, str] = {}
    for item in items:
        name = shared_fixture_of(item)
        if name is not None:
            group_of_file.setdefault(item.nodeid.split("::", 1)[0], name)
    first_position: dict[str, int] = {}
    for position, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        first_position.setdefault(group_of_file.get(path, path), position)
    place = {id(item): first_position[group_of_file.get(path, path)]
             for item in items for path in [item.nodeid.split("::", 1)[0]]}
    items.sort(key=lambda item: place[id(item)])  # stable: each file's own order is kept
    # Later items overwrite earlier ones: each service maps to the last test that takes it.
    config.stash[LAST_USERS] = {name: item.nodeid for item in items for name in SHARED_SESSION_FIXTURES
                                if name in getattr(item, "fixturenames", ())}


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    # After the last test on a shared service, stop it (and what was built on it). A later test
    # that takes it again gets a new one, so an order other than the one above costs time only.
    last_users = item.config.stash.get(LAST_USERS, {})
    if nextitem is None or item.nodeid not in last_users.values():
        return  # not the last user; or the last test of all, which the session's teardown ends
    definitions = getattr(item, "_fixtureinfo", None)
    for name, last in last_users.items():
        if last == item.nodeid and definitions is not None:
            for fixturedef in definitions.name2fixturedefs.get(name, ()):
                if fixturedef.scope == "session":
                    fixturedef.finish(item._request)  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    # xdist's own groups (--dist loadgroup) do not group under pytest 9.2: its worker renames
    # each test's node id, which no longer reaches the controller.
    from xdist.scheduler import LoadScopeScheduling

    class BySharedFixture(LoadScopeScheduling):
        """Every file on a shared service on one worker. The prompt worker (gw0, niceness 0) runs
        the units that wait on clocks and hold sub-second bounds first, then whatever is left;
        the others (niced, docs/k8s-test-env.md) never take those units, so their compute fills
        the cores while the prompt worker waits, and yields them the moment it wakes."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of_file(str(config.rootpath / nodeid.split("::", 1)[0]))

        def _assign_work_unit(self, node: Any) -> None:
            prompt = node.gateway.id == PROMPT_WORKER or len(self.nodes) == 1
            eligible = [scope for scope in self.workqueue
                        if prompt or not is_prompt_unit(scope, config.rootpath)]
            if not eligible:
                node.shutdown()  # only prompt units are left: this worker has nothing more to do
                return
            if prompt:
                eligible.sort(key=lambda scope: not is_prompt_unit(scope, config.rootpath))  # stable
            work_unit = self.workqueue.pop(eligible[0])
            self.assigned_work.setdefault(node, {})[eligible[0]] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

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
