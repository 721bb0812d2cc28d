"""One spelling of a replica's base URL, whichever side writes it."""

from __future__ import annotations

import pytest

from kvscale.base_urls import authority, base_url, normalize_base_url


@pytest.mark.parametrize("host, port, expected", [
    ("10.0.0.7", 8000, "http://10.0.0.7:8000"),
    ("fd00::5", 8000, "http://[fd00::5]:8000"),
    ("[FD00:0::5]", 8000, "http://[fd00::5]:8000"),
    ("Server-0.Chat.svc", 80, "http://server-0.chat.svc:80"),
])
def test_base_url(host, port, expected):
    assert base_url(host, port) == expected
    assert normalize_base_url(expected) == expected


@pytest.mark.parametrize("given, expected", [
    ("10.0.0.7:8000", "http://10.0.0.7:8000"),
    ("http://[fd00:0:0::5]:8000/v1/", "http://[fd00::5]:8000"),
    ("https://Replica.example:8443", "https://replica.example:8443"),
])
def test_normalize_base_url(given, expected):
    assert normalize_base_url(given) == expected


def test_authority_is_host_and_port():
    assert authority("http://[fd00:0::5]:8000/v1") == "[fd00::5]:8000"
