"""The operator's metrics listen on every address of its pod unless --metrics-host says one."""

from __future__ import annotations

import urllib.request

from kvscale.cli import build_parser
from kvscale.listen import all_addresses_host
from kvscale.operator.metrics import OperatorMetrics
from kvscale.operator.probes import Heartbeat, serve
from kvscale.processes import free_port


def scrape(host: str, port: int) -> str:
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310
        return response.read().decode()


def test_metrics_host_defaults_to_every_address():
    assert build_parser("operator").parse_args(["operator"]).metrics_host is None


def test_metrics_on_every_address_answer_ipv4_and_ipv6_loopback():
    port = free_port()
    server, thread = serve(port, all_addresses_host(), OperatorMetrics().registry, Heartbeat())
    try:
        for host in ("127.0.0.1", "::1"):
            assert "kvscale_operator" in scrape(host, port), host
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
