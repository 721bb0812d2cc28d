"""A router whose replicas reject it says so, in its log and in /health.

As a new user would try it: `--api-key` on the router and on the replica, no `--replica-api-key`.
The replica's /health is open (probes carry no key) but its API answers 401 to the router.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from kvscale.processes import wait_until
from kvscale.router.replicas import describe_check

pytestmark = pytest.mark.slow


def test_describe_check_names_the_cause() -> None:
    assert describe_check("/health", 200, None) == "ok"
    unauthorized = describe_check("/v1/models", 401, None)
    assert "401" in unauthorized and "--replica-api-key" in unauthorized
    wrong_key = describe_check("/v1/models", 401, "k")
    assert "401" in wrong_key and "rejects the key" in wrong_key
    assert "503" in describe_check("/health", 503, None)
    assert "draining" in describe_check("/health", 503, None, code="draining")


def test_router_reports_replicas_that_reject_its_key(launcher) -> None:
    replica = launcher.replica(None, "keyed", extra=["--api-key", "sk-replica"])
    router = launcher.router([replica.url], None, extra=["--api-key", "sk-replica"], health_path="/metrics")

    def unhealthy_body():
        response = httpx.get(f"{router.url}/health", timeout=5)
        body = response.json()
        return body if response.status_code == 503 and body["replicas"][0]["status"] != "not checked yet" else None

    body = wait_until(unhealthy_body, 30, what="the router's /health to report the replica")
    (entry,) = body["replicas"]
    assert entry["url"] == replica.url and entry["healthy"] is False
    assert "401" in entry["status"] and "--replica-api-key" in entry["status"]

    time.sleep(2.5)  # several more health checks (every 0.5 s): the cause is logged once
    log = router.log_tail(100_000)
    # "answered 401", not "401": a log line's timestamp can hold those digits (17:13:15,401).
    lines = [line for line in log.splitlines() if replica.url in line and "answered 401" in line]
    assert len(lines) == 1, log
    assert "--replica-api-key" in lines[0]

    # A new state is reported once more: the replica goes away.
    replica.proc.send_signal(signal.SIGKILL)
    replica.proc.wait(10)

    def gone():
        entry = httpx.get(f"{router.url}/health", timeout=5).json()["replicas"][0]
        return entry if "401" not in entry["status"] else None

    entry = wait_until(gone, 30, what="the router to notice the replica is gone")
    assert "connect" in entry["status"].lower(), entry
    time.sleep(2.5)
    log = router.log_tail(100_000)
    assert len([line for line in log.splitlines() if replica.url in line and "answered 401" in line]) == 1, log
    down = [line for line in log.splitlines() if replica.url in line and "connect" in line.lower()]
    assert len(down) == 1, log
