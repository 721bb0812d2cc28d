"""A benchmark stopped from outside (SIGTERM, Ctrl-C in another terminal, a timeout) leaves no
server behind: the servers it spawns die with it, and level (a) of the autoscaling replay stops
the platform it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvscale.processes import wait_until

REPO = Path(__file__).resolve().parents[2]

SPAWNER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from bench.http_servers import spawn
    server = spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ),
                   0, "none", Path(sys.argv[1]), Path.cwd())
    print(server.proc.pid, flush=True)
    time.sleep(120)
""")


# `python -m MODULE ARGS...` with Ctrl-C's default handling. A process started in the
# background by a non-interactive shell (`make test &`, a CI runner's script) inherits SIGINT
# ignored, and Python keeps an ignored SIGINT ignored: the bench would never see the signal.
AS_FROM_A_TERMINAL = textwrap.dedent("""
    import runpy, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent, the spawner, is dead and init reaps it).
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_a_benchmark_killed_from_outside_takes_its_servers_with_it(tmp_path) -> None:
    spawner = subprocess.Popen([sys.executable, "-c", SPAWNER, str(tmp_path)], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert spawner.stdout is not None
        child = int(spawner.stdout.readline())
        assert alive(child)
        spawner.send_signal(signal.SIGTERM)  # skips the benchmark's finally: stop(server)
        spawner.wait(10)
        wait_until(lambda: not alive(child), 10, interval=0.1, what=f"spawned server {child} to exit")
    finally:
        spawner.kill()
        spawner.wait()


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """Every process below ``root`` now: pid -> (start time, name). The start time tells a
    process from a later one given the same pid."""
    parents: dict[int, int] = {}
    seen: dict[int, tuple[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                name, rest = stat.read().rsplit(")", 1)
        except OSError:  # gone meanwhile
            continue
        fields = rest.split()  # after "(comm)": state, ppid, ..., starttime (the 20th)
        parents[int(entry)] = int(fields[1])
        seen[int(entry)] = (fields[19], name.split("(", 1)[1])
    below, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in below} - below
        below |= more
        grew = bool(more)
    below.discard(root)
    return {pid: seen[pid] for pid in below}


def still_running(pid: int, started: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == started and fields[0] != "Z"


@pytest.mark.slow
@pytest.mark.k8s
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_level_a_stopped_from_outside_stops_the_platform_it_started(tmp_path, stop: int) -> None:
    """A signal once the control plane, the pods and Prometheus run: the bench stops them all as
    on a normal exit (the pods' network namespaces and the run's folder go only in its
    `finally`, which Python's default for SIGTERM skips)."""
    from pod_network import PodNetwork

    log = open(tmp_path / "bench.log", "wb")  # noqa: SIM115 - the bench holds it
    bench = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, "bench.autoscale_replay", "--level", "a",
         "--policies", "hpa-real", "--span", "20"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        # Its temporary folder (tempfile's) under tmp_path: the test finds the platform there.
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    log.close()
    started: dict[int, tuple[str, str]] = {}
    network = None
    try:
        def platform_up() -> bool:  # Prometheus, and the prometheus-adapter pod it serves
            assert bench.poll() is None, (tmp_path / "bench.log").read_text()[-3000:]
            started.update(descendants(bench.pid))
            names = {name for _, name in started.values()}
            return "prometheus" in names and "prometheus-adap" in names  # comm: 15 characters

        wait_until(platform_up, 300, interval=0.2, what="level (a)'s Prometheus and adapter pod")
        (state,) = tmp_path.glob("kvscale-level-a-*/env/env.json")
        env = json.loads(state.read_text())
        network = PodNetwork(env["pod_cidr"], env["service_cidr"])
        assert network.leftovers()["netns"]
        bench.send_signal(stop)
        assert bench.wait(120) != 0, "stopped, not finished"

        def survivors() -> dict[int, str]:
            return {pid: name for pid, (since, name) in started.items() if still_running(pid, since)}

        # A moment for what its death signal (PR_SET_PDEATHSIG) reached to exit.
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not survivors(), 10, what="the platform's processes to exit")
        assert not survivors(), f"still running after the bench exited: {survivors()}"
        assert network.leftovers() == {"netns": [], "links": [], "routes": []}
        assert not list(tmp_path.glob("kvscale-level-a-*")), "its temporary folder is left"
    finally:
        bench.kill()
        bench.wait()
        for pid, (since, _) in started.items():  # what a failed run left behind
            if still_running(pid, since):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if network is not None:
            for name in network.leftovers()["netns"]:
                subprocess.run(["ip", "netns", "del", name], check=False)
            for link in network.leftovers()["links"]:
                subprocess.run(["ip", "link", "del", link], check=False)
            subprocess.run(["ip", "route", "del", "local", str(network.services), "dev", "lo",
                            "table", "local"], check=False, capture_output=True)
