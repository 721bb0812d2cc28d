"""`kvscale serve` with no --host listens on every address (kvscale.drain.serve's dual-stack
socket) and still tells routers its pod IP, from the downward API's POD_IP."""

from __future__ import annotations

from kvscale.cli import build_parser
from kvscale.server.entrypoints.cli_serve import advertised_base_url


def test_no_host_flag_means_every_address():
    args = build_parser("serve").parse_args(["serve"])
    assert args.host is None
    assert build_parser("serve").parse_args(["serve", "--host", "10.0.0.7"]).host == "10.0.0.7"


def test_bound_to_every_address_it_advertises_the_pod_ip(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert advertised_base_url(None, 8000) == "http://10.1.2.3:8000"
    monkeypatch.setenv("POD_IP", "fd00::5")
    assert advertised_base_url(None, 8000) == "http://[fd00::5]:8000"
