"""Probes that see a hang, and health that does not flip on one blip.

- Every replica paused for 3 s (SIGSTOP, as a long GC or a throttled node does): no request
  fails and the router's /health, its readiness, never leaves 200, so no endpoint leaves its
  Service. One failed 2 s check used to mark a replica down.
- The router's liveness (`/ping`) is answered by its event loop: a stopped router accepts TCP
  connections in the kernel (what the old tcpSocket probe checked) but never answers /ping.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_a_three_second_pause_of_every_replica_fails_nothing(launcher) -> None:
    replicas = [launcher.replica(None, f"paused-{i}") for i in range(2)]
    router = launcher.router([r.url for r in replicas], None, extra=["--health-interval", "0.5"])
    failures: list[str] = []
    health: list[int] = []
    done = threading.Event()
    answered = 0

    def load() -> None:
        nonlocal answered
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                try:
                    response = client.post(f"{router.url}/v1/completions", json={
                        "model": "smollm2-135m-instruct", "prompt": "Pause test:", "max_tokens": 2})
                    if response.status_code != 200:
                        failures.append(f"{response.status_code} {response.text[:200]}")
                    answered += 1
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))

    def watch_health() -> None:
        with httpx.Client(timeout=2) as client:
            while not done.is_set():
                try:
                    health.append(client.get(f"{router.url}/health").status_code)
                except httpx.HTTPError:
                    health.append(0)
                time.sleep(0.25)

    threads = [threading.Thread(target=load), threading.Thread(target=load),
               threading.Thread(target=watch_health)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2)
        for replica in replicas:
            replica.proc.send_signal(signal.SIGSTOP)
        time.sleep(3)
        for replica in replicas:
            replica.proc.send_signal(signal.SIGCONT)
        time.sleep(3)
    finally:
        for replica in replicas:
            replica.proc.send_signal(signal.SIGCONT)
        done.set()
        for thread in threads:
            thread.join(90)
    assert answered > 0 and failures == [], failures
    assert health and set(health) == {200}, health


def test_liveness_is_answered_by_the_event_loop_not_the_kernel(launcher) -> None:
    router = launcher.router(["http://127.0.0.1:9"], None, health_path="/ping")
    assert httpx.get(f"{router.url}/ping", timeout=5).status_code == 200
    router.proc.send_signal(signal.SIGSTOP)
    try:
        port = int(router.url.rsplit(":", 1)[1])
        # What a tcpSocket probe sees: the kernel still completes the handshake.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{router.url}/ping", timeout=2)
    finally:
        router.proc.send_signal(signal.SIGCONT)
    assert httpx.get(f"{router.url}/ping", timeout=5).status_code == 200
