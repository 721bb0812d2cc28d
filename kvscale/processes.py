"""Helpers for the local processes kvscale starts (replicas, Redis, control plane) and their ports."""

from __future__ import annotations

import ctypes
import gc
import random
import signal
import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1


_handed_out_ports: set[int] = set()


def _listening_port_candidates() -> range:
    """Ports outside the kernel's ephemeral range: an outbound connection (a probe, a Redis or
    kube client) can take an ephemeral port between the choice and the server's bind; nothing
    but an explicit bind takes one of these."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low, high = (int(bound) for bound in ports.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(max(1024, low - 16384), low) if low > 2048 else range(high + 1, 65536)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, never handed out before by this process; the caller
    binds it soon after."""
    candidates = _listening_port_candidates()
    for _ in range(1000):
        port = random.choice(candidates)
        if port in _handed_out_ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out_ports.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {candidates.start}-{candidates.stop - 1}")


def wait_until(
    predicate: Callable[[], T], timeout: float, *, interval: float = 0.1, what: str = "condition"
) -> T:
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_for_port(port: int, timeout: float, host: str = "127.0.0.1", what: str = "") -> None:
    wait_until(lambda: port_open(host, port), timeout, interval=0.05,
               what=f"{what or 'something'} to listen on {host}:{port}")


def die_with_parent() -> None:
    """For Popen(preexec_fn=...): the kernel SIGTERMs the child when its parent dies, however
    it dies (SIGKILL included), so no replica or control-plane component outlives its owner."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def freeze_startup_heap() -> int:
    """Move every object alive now into the garbage collector's permanent generation.

    A serving process holds torch and transformers (about 390,000 objects once a tokenizer is
    loaded); every full collection walks all of them (211 ms here: bench/router_decision.py), and
    happens at random moments under load: a stall of the event loop and, in a replica, of the
    engine thread. What start-up built lives until exit, so it needs no collecting. Call once,
    when start-up is done (as vLLM's server does). Returns how many objects are frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
