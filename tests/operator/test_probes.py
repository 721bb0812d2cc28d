"""The operator's liveness sees a stuck loop: /healthz is answered from the
HTTP thread but reports the heartbeat the working loop beats, so a wedged event loop turns it
503 while /metrics (the old probe) keeps answering 200."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

from kvscale.listen import all_addresses_host
from kvscale.operator.metrics import OperatorMetrics
from kvscale.operator.probes import Heartbeat, beat_forever, serve
from kvscale.processes import free_port, wait_until


def get(host: str, port: int, path: str) -> int:
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_wedged_event_loop_fails_healthz_not_metrics() -> None:
    heartbeat = Heartbeat(max_age_s=1.0)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    beating = asyncio.run_coroutine_threadsafe(beat_forever(heartbeat), loop)
    port = free_port()
    server, thread = serve(port, "127.0.0.1", OperatorMetrics().registry, heartbeat)
    try:
        wait_until(lambda: get("127.0.0.1", port, "/healthz") == 200, 10, what="healthz 200")
        # A handler that blocks the loop (a synchronous call where an await belonged).
        loop.call_soon_threadsafe(time.sleep, 4)
        wait_until(lambda: get("127.0.0.1", port, "/healthz") == 503, 10, what="healthz 503")
        assert get("127.0.0.1", port, "/metrics") == 200  # what the old probe asked: blind to it
        wait_until(lambda: get("127.0.0.1", port, "/healthz") == 200, 15, what="healthz back")
        assert get("127.0.0.1", port, "/other") == 404
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        beating.cancel()
        loop.call_soon_threadsafe(loop.stop)


def test_metrics_and_healthz_answer_ipv4_and_ipv6_loopback() -> None:
    port = free_port()
    server, thread = serve(port, all_addresses_host(), OperatorMetrics().registry, Heartbeat())
    try:
        for host in ("127.0.0.1", "::1"):
            assert get(host, port, "/metrics") == 200 and get(host, port, "/healthz") == 200, host
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_operator_pod_is_probed_on_healthz() -> None:
    """deploy/operator.yaml is the chart rendered (make deploy-render; a chart test keeps it so)."""
    from pathlib import Path

    import yaml

    manifests = Path(__file__).resolve().parents[2] / "deploy" / "operator.yaml"
    deployment = next(d for d in yaml.safe_load_all(manifests.read_text())
                      if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
