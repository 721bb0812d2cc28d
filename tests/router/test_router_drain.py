"""Server and router side: SIGTERM under streaming load loses nothing.

Real processes: two `kvscale serve` replicas of the bundled model behind a real `kvscale router`,
the official `openai` client streaming through the router from several threads. A replica gets
SIGTERM while streams run on it (a rolling update or a scale-in): it must fail readiness at once,
turn new requests away with a 503 the router retries elsewhere, finish its streams, and exit 0.
Then the router itself gets SIGTERM mid-stream and must do the same.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from kvscale.processes import wait_until

pytestmark = pytest.mark.slow

# A stream must still be running when the test's checks after SIGTERM reach the draining process
# (else it has already left, and they meet a closed port) and outlive uvicorn's old 5 s graceful
# timeout, yet end well within the pod's grace period. Machines differ by several times in speed
# (an AVX2 core in float32, an AVX-512 one in bfloat16), so the length is set from a measured rate:
# about STREAM_SECONDS at the rate of one stream alone, slower still under the test's load. At most
# 240: four such streams fit a replica's 64 blocks of 16 (tests/router/conftest.py) without preemption.
STREAM_SECONDS = 8.0
MIN_TOKENS, MAX_TOKENS = 64, 240
CLIENTS = 4


@dataclass
class Result:
    replica: str
    started: float
    ended: float
    finish_reason: str | None
    chunks: int
    error: str | None = None


class StreamingLoad:
    """CLIENTS threads, each streaming one completion after another through ``base_url``."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=180)
        self.max_tokens = max_tokens
        self.results: list[Result] = []
        self.active: dict[int, str] = {}  # thread -> replica it is streaming from now
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def start(self) -> StreamingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def join(self) -> list[Result]:
        self.stop.set()
        for thread in self._threads:
            thread.join(240)
        return self.results

    def streaming_on(self, replica: str) -> int:
        with self._lock:
            return sum(1 for r in self.active.values() if r == replica)

    def _run(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            started = time.monotonic()
            replica, finish, chunks, error = "?", None, 0, None
            try:
                raw = self.client.completions.with_raw_response.create(
                    model="smollm2-135m-instruct", prompt=f"Client {index}, story {n}: once upon a time",
                    max_tokens=self.max_tokens, temperature=0.8, stream=True, extra_body={"ignore_eos": True})
                replica = raw.headers.get("x-kvscale-replica", "?")
                with self._lock:
                    self.active[index] = replica
                for chunk in raw.parse():
                    chunks += 1
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                error = f"{type(exc).__name__}: {exc}"
            finally:
                with self._lock:
                    self.active.pop(index, None)
                    self.results.append(Result(replica, started, time.monotonic(), finish, chunks, error))


def tokens_lasting(base_url: str, seconds: float) -> int:
    """How many tokens one stream alone takes ``seconds`` to generate on this machine, measured."""
    def complete(tokens: int) -> float:
        started = time.monotonic()
        httpx.post(f"{base_url}/v1/completions", timeout=120, json={
            "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        }).raise_for_status()
        return time.monotonic() - started

    complete(2)  # the first steps of a fresh process are slow ones
    probe = 32
    rate = probe / complete(probe)
    print(f"one stream alone: {rate:.1f} tokens/s")
    return max(MIN_TOKENS, min(MAX_TOKENS, int(rate * seconds)))


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if r.error or r.finish_reason != "length"]


def test_sigterm_under_streaming_load_loses_no_request(launcher) -> None:
    victim = launcher.replica(None, "victim")
    survivor = launcher.replica(None, "survivor")
    router = launcher.router([victim.url, survivor.url], None, policy="round-robin")
    victim_id = victim.url.removeprefix("http://")
    stream_tokens = tokens_lasting(survivor.url, STREAM_SECONDS)

    load = StreamingLoad(router.url, stream_tokens).start()
    try:
        wait_until(lambda: load.streaming_on(victim_id) >= 1, 120, what="a stream on the victim")
        time.sleep(1.0)  # well into its streams
        on_victim = load.streaming_on(victim_id)
        terminated = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)

        # Readiness fails at once, and new work is turned away with the OpenAI error body.
        health = wait_until(lambda: _get(f"{victim.url}/health"), 5, what="victim's /health")
        assert health.status_code == 503, health.text
        assert health.json()["error"]["code"] == "draining"
        direct = httpx.post(f"{victim.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert direct.status_code == 503 and direct.headers["x-kvscale-draining"] == "1"
        assert direct.json()["error"]["code"] == "draining"

        # The load goes on until the victim has finished its streams and left.
        assert victim.proc.wait(120) == 0, victim.log_tail()
        exited = time.monotonic()
        wait_until(lambda: any(r.started > exited for r in load.results), 120,
                   what="a request sent after the victim left")
    finally:
        results = load.join()

    assert not failures(results), failures(results)
    finished_late = [r for r in results if r.replica == victim_id and r.started < terminated < r.ended]
    assert len(finished_late) >= on_victim >= 1
    assert exited - terminated < 60  # within the pod's grace period
    after = [r for r in results if r.started > exited]
    assert after and all(r.replica != victim_id for r in after)

    # The router drains the same way: its streams finish, new requests get 503, it exits 0.
    load = StreamingLoad(router.url, stream_tokens).start()
    try:
        wait_until(lambda: load.streaming_on(survivor.url.removeprefix("http://")) >= CLIENTS - 1, 120,
                   what="streams through the router")
        time.sleep(0.5)
        router.proc.send_signal(signal.SIGTERM)
        health = wait_until(lambda: _get(f"{router.url}/health"), 5, what="router's /health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        load.stop.set()  # no new requests; the open streams must still finish
        assert router.proc.wait(120) == 0, router.log_tail()
    finally:
        results = load.join()
    streamed = [r for r in results if r.replica != "?"]
    assert streamed and not failures(streamed), failures(streamed)


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None
