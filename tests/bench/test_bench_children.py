"""A benchmark stopped from outside (SIGTERM, Ctrl-C in another terminal, a timeout) leaves no
server behind: the servers it spawns die with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from kvscale.processes import wait_until

SPAWNER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from bench.http_load import spawn
    server = spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ),
                   0, "none", Path(sys.argv[1]), Path.cwd())
    print(server.proc.pid, flush=True)
    time.sleep(120)
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
