"""The periodic loops: InferenceServices run side by side, a stuck one holds back no other,
scrapes run outside the per-object lock, and a stalled loop shows in /healthz."""

from __future__ import annotations

import contextvars
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvscale.operator import autoscale as autoscale_module
from kvscale.operator import periodic
from kvscale.operator.config import OperatorConfig
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.probes import Heartbeat
from kvscale.operator.runtime import Runtime


class FakeKube:
    """Just what one autoscale run reads: the InferenceService (gone on the second read) and no pods."""

    def __init__(self, uid: str):
        self.reads = 0
        self.uid = uid

    def get(self, path: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.reads > 1:
            return None
        return {"metadata": {"name": "svc", "namespace": "ns", "uid": self.uid},
                "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, "replicas": 1}}

    def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        return []


def test_a_stuck_inference_service_holds_back_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    runs: list[str] = []

    def handler(runtime: Runtime, key: ObjectKey, logger: Any) -> None:
        runs.append(key.name)
        if key.name == "stuck":
            release.wait(10)

    monkeypatch.setattr(periodic, "autoscale", handler)
    runtime = Runtime(kube=None, config=OperatorConfig(scrape_interval=1.0))  # type: ignore[arg-type]
    runtime.watched = {"u1": ObjectKey(uid="u1", namespace="ns", name="stuck"), "u2": ObjectKey(uid="u2", namespace="ns", name="fine")}
    with ThreadPoolExecutor(4) as pool:
        periodic.periodic_round(runtime, "autoscale", 100.0, pool)
        periodic.periodic_round(runtime, "autoscale", 102.0, pool)  # "stuck" is still running
        release.set()
    assert sorted(runs) == ["fine", "fine", "stuck"]
    assert runtime.in_flight["autoscale"] == {}


KOPF_LIKE = contextvars.ContextVar[str]("kopf_like")


def test_handlers_run_in_the_loops_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf.event reads kopf's settings from context variables: a handler on the pool's thread
    must see the context of the loop that started it, as asyncio.to_thread gives."""
    seen: list[str | None] = []
    monkeypatch.setattr(periodic, "autoscale",
                        lambda runtime, key, logger: seen.append(KOPF_LIKE.get(None)))
    runtime = Runtime(kube=None, config=OperatorConfig())  # type: ignore[arg-type]
    runtime.watched = {"u1": ObjectKey(uid="u1", namespace="ns", name="svc")}
    token = KOPF_LIKE.set("kopf settings")
    try:
        with ThreadPoolExecutor(1) as pool:
            periodic.periodic_round(runtime, "autoscale", 1.0, pool)
    finally:
        KOPF_LIKE.reset(token)
    assert seen == ["kopf settings"]


def test_scrapes_run_without_the_lock_reconcile_waits_on(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Runtime(kube=FakeKube("u1"), config=OperatorConfig())  # type: ignore[arg-type]
    free_while_scraping: list[bool] = []

    def scrape_pods(*args: Any) -> list[Any]:
        lock = runtime.lock("u1")
        free = lock.acquire(blocking=False)
        if free:
            lock.release()
        free_while_scraping.append(free)
        return []

    monkeypatch.setattr(autoscale_module.scraping, "scrape_pods", scrape_pods)
    autoscale_module.autoscale(runtime, ObjectKey(uid="u1", namespace="ns", name="svc"), logging.getLogger("test"))
    assert free_while_scraping == [True]


def test_a_loop_without_rounds_or_a_run_stuck_for_minutes_fails_healthz() -> None:
    runtime = Runtime(kube=None, config=OperatorConfig(scrape_interval=5.0))  # type: ignore[arg-type]
    heartbeat = Heartbeat()
    heartbeat.add_check(lambda: periodic.stalled(runtime, now))
    now = 1000.0
    runtime.rounds = {"autoscale": 990.0}
    assert heartbeat.verdict()[0]
    now = 1021.0  # 31 s without a round
    ok, text = heartbeat.verdict()
    assert not ok and "periodic autoscale: no round for 31 s" in text
    runtime.rounds = {"autoscale": now}
    runtime.watched = {"u1": ObjectKey(uid="u1", namespace="ns", name="svc")}
    runtime.in_flight = {"autoscale": {"u1": now - periodic.RUN_STALL_S - 1}}
    ok, text = heartbeat.verdict()
    assert not ok and "ns/svc" in text
