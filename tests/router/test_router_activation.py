"""Holding requests while no replica is ready (router/activation.py).

The decisions are pure functions; `Activation` runs on a real event loop; the end-to-end cases
start a real `kvscale router --hold-timeout` whose replica does not exist yet, then a real
`kvscale serve` on that address, with the official openai client sending the requests.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import openai
import pytest

from kvscale.processes import free_port, wait_until
from kvscale.router import activation as holding
from kvscale.router.metrics import RouterMetrics
from kvscale.router.wake import scale_patch
from tests.router.conftest import BLOCK_SIZE, MODEL, spawn, spawn_router

LIMITS = holding.HoldLimits(timeout_s=30.0, max_held=2)


def test_admission_routes_holds_or_refuses() -> None:
    assert holding.admission(True, 5, LIMITS) == holding.ROUTE
    assert holding.admission(False, 0, None) == holding.ROUTE  # holding off: the old 503 path
    assert holding.admission(False, 1, LIMITS) == holding.HOLD
    assert holding.admission(False, 2, LIMITS) == holding.FULL


def test_retry_after_is_the_last_cold_start_or_the_hold_limit() -> None:
    assert holding.retry_after_s(None, LIMITS) == 30
    assert holding.retry_after_s(4.2, LIMITS) == 5
    assert holding.retry_after_s(0.01, LIMITS) == 1


def test_idle_is_zero_while_anything_is_open_or_held() -> None:
    assert holding.idle_seconds(100.0, 40.0, 0, 0) == 60.0
    assert holding.idle_seconds(100.0, 40.0, 1, 0) == 0.0
    assert holding.idle_seconds(100.0, 40.0, 0, 3) == 0.0


def test_the_scale_is_raised_from_zero_only_and_guarded_by_its_version() -> None:
    at_zero = {"metadata": {"resourceVersion": "17"}, "spec": {}}  # replicas 0 is omitted
    assert scale_patch(at_zero) == {"metadata": {"resourceVersion": "17"}, "spec": {"replicas": 1}}
    assert scale_patch({"metadata": {"resourceVersion": "18"}, "spec": {"replicas": 2}}) is None


def test_held_requests_are_released_timed_out_or_freed_on_disconnect() -> None:
    async def scenario() -> dict[str, object]:
        wakes: list[float] = []

        async def wake() -> None:
            wakes.append(time.monotonic())

        metrics = RouterMetrics()
        act = holding.Activation(holding.HoldLimits(timeout_s=0.6, max_held=10), metrics, wake)
        act.update(False)

        async def never_gone() -> bool:
            return False

        gone = asyncio.Event()

        async def leaves() -> bool:
            return gone.is_set()

        released = asyncio.create_task(act.hold(never_gone))
        disconnected = asyncio.create_task(act.hold(leaves))
        await asyncio.sleep(0.05)
        held_before = act.held
        gone.set()
        assert await disconnected == holding.DISCONNECTED
        act.update(True)  # a replica came up
        assert await released == holding.RELEASED
        act.update(False)  # scaled to zero again: the next one times out
        timed_out = await act.hold(never_gone)
        return {"held_before": held_before, "held_after": act.held, "timed_out": timed_out,
                "wakes": len(wakes), "cold_start": act.last_cold_start_s,
                "metrics": metrics}

    result = asyncio.run(scenario())
    assert result["held_before"] == 2 and result["held_after"] == 0
    assert result["timed_out"] == holding.TIMEOUT
    assert result["wakes"] >= 1
    assert result["cold_start"] is not None and 0 < result["cold_start"] < 5
    metrics = result["metrics"]
    assert isinstance(metrics, RouterMetrics)
    counts = {s.labels["outcome"]: s.value for f in metrics.holds.collect() for s in f.samples
              if s.name.endswith("_total")}
    assert counts == {"released": 1, "timeout": 1, "full": 0, "disconnected": 1}


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


@pytest.mark.slow
def test_requests_held_at_zero_replicas_are_answered_once_a_replica_is_up(launcher) -> None:
    port = free_port()
    replica_url = f"http://127.0.0.1:{port}"
    router = launcher.router([replica_url], None, extra=["--hold-timeout", "300", "--hold-queue", "64",
                                                        "--served-model-name", MODEL])
    # No replica yet: the router is ready all the same (it holds).
    assert _health(router.url)["activation"]["held"] == 0
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # The model is listed at zero replicas: asking for it is what brings one.
    assert [m.id for m in client.models.list().data] == [MODEL]
    results: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            if i % 2:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model=MODEL, prompt=f"Count {i}:", max_tokens=4, temperature=0, stream=True)
                    if c.choices)
            else:
                text = client.completions.create(
                    model=MODEL, prompt=f"Count {i}:", max_tokens=4, temperature=0).choices[0].text
            outcome = "ok" if text is not None else "empty"
        except Exception as exc:  # every failure counted
            outcome = f"{type(exc).__name__}: {exc}"
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    wait_until(lambda: _health(router.url)["activation"]["held"] == 12, 30, interval=0.2,
               what="12 requests held")
    # A client that gives up while held frees its place.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", timeout=1.0,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    wait_until(lambda: _health(router.url)["activation"]["held"] == 12, 5, interval=0.2,
               what="the disconnected request's place freed")
    replica = spawn(["serve", "--host", "127.0.0.1", "--port", str(port), "--block-size",
                     str(BLOCK_SIZE), "--max-model-len", "512", "--max-num-seqs", "8"],
                    port, "late-replica")
    launcher.started.append(replica)
    for thread in threads:
        thread.join(120)
    assert results == ["ok"] * 12, results
    activation = _health(router.url)["activation"]
    assert activation["held"] == 0 and activation["last_cold_start_seconds"] > 0
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'kvscale_router_holds_total{outcome="released"} 12.0' in metrics
    assert 'kvscale_router_holds_total{outcome="disconnected"} 1.0' in metrics


def test_a_hold_past_its_limit_or_over_the_queue_is_503_with_retry_after(launcher) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = spawn_router([dead], None, extra=["--hold-timeout", "1", "--hold-queue", "1"])
    launcher.started.append(router)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    first: list[httpx.Response] = []
    holder = threading.Thread(
        target=lambda: first.append(httpx.post(router.url + "/v1/completions", json=body, timeout=10)))
    holder.start()
    wait_until(lambda: _health(router.url)["activation"]["held"] == 1, 5, interval=0.05,
               what="one request held")
    full = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
    holder.join(10)
    for response, words in ((full, "hold queue is full"), (first[0], "within 1 s")):
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and words in error["message"]
    # The official client reads it as its own error type.
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)


@pytest.mark.slow
def test_a_request_whose_last_replica_vanished_is_held_for_the_next(launcher) -> None:
    """The service scaled to zero as the request arrived: its replica refused the connection
    before any byte reached the client, so the router holds it (rather than answer 502) and sends
    it to the replica that comes up next."""
    port = free_port()
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK_SIZE),
            "--max-model-len", "512", "--max-num-seqs", "8"]
    first = spawn(args, port, "first-replica")
    launcher.started.append(first)
    router = launcher.router([f"http://127.0.0.1:{port}"], None,
                             extra=["--hold-timeout", "300", "--health-interval", "5"])
    wait_until(lambda: _health(router.url)["replicas"][0]["healthy"], 30, interval=0.2,
               what="the replica healthy")
    first.stop(signal.SIGKILL)
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(httpx.post(
        router.url + "/v1/completions", timeout=300,
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})))
    sender.start()
    wait_until(lambda: _health(router.url)["activation"]["held"] == 1 or answers, 30, interval=0.1,
               what="the request held after its replica vanished")
    assert not answers, (answers[0].status_code, answers[0].text, router.log_tail())
    second = spawn(args, port, "second-replica")
    launcher.started.append(second)
    sender.join(120)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json()["choices"][0]["text"] is not None
