"""Scraping real HTTP endpoints: parsing, timeouts, errors and the address override."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from operator_helpers import MetricsEndpoint, PodMetrics

from kvscale.operator.scraping import (
    METRICS_URL_ANNOTATION,
    metrics_url,
    parse_metrics,
    scrape_pods,
)


def ready_pod(name: str, url: str | None = None, ip: str = "127.244.0.7", ready: bool = True) -> dict:
    return {
        "metadata": {"name": name, "annotations": {METRICS_URL_ANNOTATION: url} if url else {}},
        "status": {"podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


@pytest.fixture
def endpoints():
    made: list[MetricsEndpoint] = []

    def make(**metrics) -> MetricsEndpoint:
        endpoint = MetricsEndpoint(PodMetrics(**metrics))
        made.append(endpoint)
        return endpoint

    yield make
    for endpoint in made:
        endpoint.close()


def test_parse_sums_over_label_sets():
    text = (
        "# TYPE kvscale:kv_blocks_active gauge\n"
        'kvscale:kv_blocks_active{model_name="a"} 10\n'
        'kvscale:kv_blocks_active{model_name="b"} 5\n'
        "# TYPE kvscale:kv_blocks_total gauge\n"
        'kvscale:kv_blocks_total{model_name="a"} 100\n'
        "vllm:num_requests_waiting 3\n"
        "vllm:num_requests_running 9\n"
        'kvscale:max_num_seqs{model_name="a"} 16\n'
        'kvscale:prefill_tokens_waiting{model_name="a"} 512\n'
        'kvscale:prefill_tokens_per_s{model_name="a"} 256.5\n'
    )
    assert parse_metrics(text) == {"kvscale:kv_blocks_active": 15.0,
                                   "kvscale:kv_blocks_total": 100.0,
                                   "vllm:num_requests_waiting": 3.0,
                                   # scale to zero: a pod busy around the routers is not idle
                                   "vllm:num_requests_running": 9.0,
                                   "kvscale:max_num_seqs": 16.0,
                                   # the queued prefill seconds: tokens / the measured rate
                                   "kvscale:prefill_tokens_waiting": 512.0,
                                   "kvscale:prefill_tokens_per_s": 256.5}


def test_override_is_honoured_only_when_allowed():
    pod = ready_pod("p", url="http://127.0.0.1:9/metrics", ip="127.244.0.9")
    assert metrics_url(pod, allow_override=True) == "http://127.0.0.1:9/metrics"
    assert metrics_url(pod, allow_override=False) == "http://127.244.0.9:8000/metrics"
    assert metrics_url(ready_pod("q", ip="fd00::5"), False) == "http://[fd00::5]:8000/metrics"


def test_scrape_ready_pods_in_parallel_with_timeouts_and_errors(endpoints):
    busy = endpoints(kv_blocks_active=800, kv_blocks_total=1000, num_requests_waiting=4,
                     prefill_tokens_waiting=600, prefill_tokens_per_s=300)
    slow = endpoints(delay_s=3.0)
    broken = endpoints(status=500)
    silent = endpoints(omit_kv=True)
    pods = [ready_pod("busy", busy.url), ready_pod("slow", slow.url),
            ready_pod("broken", broken.url), ready_pod("silent", silent.url),
            ready_pod("starting", busy.url, ready=False)]
    started = time.monotonic()
    loads = {load.pod: load for load in scrape_pods(pods, timeout=0.5, allow_override=True)}
    elapsed = time.monotonic() - started
    assert set(loads) == {"busy", "slow", "broken", "silent"}  # not-ready pods are not scraped
    assert loads["busy"].has_metrics and loads["busy"].kv_usage == pytest.approx(0.8)
    assert loads["busy"].num_requests_waiting == 4
    assert (loads["busy"].prefill_tokens_waiting, loads["busy"].prefill_tokens_per_s) == (600, 300)
    assert loads["slow"].error == "scrape timed out" and not loads["slow"].has_metrics
    assert loads["broken"].error == "HTTP 500"
    assert "kvscale:kv_blocks_active" in loads["silent"].error
    assert elapsed < 2.5  # one timeout, not one per pod in sequence


class HostilePod:
    """A raw HTTP server answering every connection in one of two hostile ways: `drip` sends
    Prometheus text one byte per 0.1 s (each read well inside a per-read timeout), `flood`
    sends a chunked body without end."""

    def __init__(self, mode: str):
        self.mode = mode
        self._server = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.getsockname()[1]}/metrics"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                piece = b"# x\n" if self.mode == "drip" else b"#" * 65535 + b"\n"
                chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
                while not self._stop.is_set():
                    conn.sendall(chunk)
                    if self.mode == "drip":
                        time.sleep(0.1)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._server.close()


@pytest.mark.parametrize("mode,error", [("drip", "within"), ("flood", "byte cap")])
def test_a_hostile_pod_is_cut_off_by_a_whole_scrape_deadline_and_a_byte_cap(mode, error):
    pod = HostilePod(mode)
    try:
        started = time.monotonic()
        [load] = scrape_pods([ready_pod("hostile", pod.url)], timeout=0.5, allow_override=True,
                             max_bytes=1 << 20)
        elapsed = time.monotonic() - started
    finally:
        pod.close()
    assert error in load.error and not load.has_metrics
    assert elapsed < 3.0  # the deadline plus one read timeout (0.5 s each), not forever
