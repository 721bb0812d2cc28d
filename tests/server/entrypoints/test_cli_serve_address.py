"""What `kvscale serve` tells routers about itself: a base URL they can dial and match."""

from __future__ import annotations

import pytest

from kvscale.server.entrypoints.cli_serve import advertised_base_url


@pytest.mark.parametrize("pod_ip, expected", [
    ("10.1.2.3", "http://10.1.2.3:8000"),
    ("fd00::5", "http://[fd00::5]:8000"),  # a single-stack IPv6 cluster
    ("fd00:0:0::5", "http://[fd00::5]:8000"),
])
def test_a_wildcard_bind_advertises_the_pod_ip_as_a_url(monkeypatch, pod_ip, expected):
    monkeypatch.setenv("POD_IP", pod_ip)
    for wildcard in ("0.0.0.0", "::"):
        assert advertised_base_url(wildcard, 8000) == expected


def test_an_explicit_ipv6_host_is_bracketed():
    assert advertised_base_url("::1", 8001) == "http://[::1]:8001"
