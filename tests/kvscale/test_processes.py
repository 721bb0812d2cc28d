"""Process helpers: the start-up heap freeze that keeps full GCs off the serving path, and ports."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from kvscale.processes import free_port

_PROBE = """
import gc, json
from kvscale.processes import freeze_startup_heap
startup = [[i] for i in range(200_000)]  # stands in for torch/transformers' objects
before = len(gc.get_objects())
freeze_startup_heap()
after = len(gc.get_objects())
garbage = []
garbage.append(garbage)  # a cycle made after start-up is still collected
del garbage
print(json.dumps({"before": before, "after": after, "frozen": gc.get_freeze_count(),
                  "collected": gc.collect()}))
"""


def test_freeze_startup_heap_leaves_full_collections_only_new_objects():
    # A child process: freezing pytest's own heap would keep every later test's garbage.
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    counts = json.loads(probe.stdout)
    assert counts["before"] > 200_000
    assert counts["frozen"] >= 200_000
    # What a full collection walks now: a few objects, not the start-up heap.
    assert counts["after"] < counts["before"] // 20
    assert counts["collected"] >= 1


def _ephemeral_range() -> range:
    low, high = (int(bound) for bound in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    return range(low, high + 1)


def test_free_port_stays_out_of_the_kernels_ephemeral_range():
    """A port from the ephemeral range can be taken by any outbound connection (a health probe,
    a Redis or kube client) between choosing it and the server binding it: CI lost a run to
    `address already in use` that way. Ports below the range are only ever taken by a bind."""
    ephemeral = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert not [port for port in ports if port in ephemeral]
    assert all(1024 <= port < 65536 for port in ports)
    # Handed out once per process: two servers started side by side never get the same port.
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
