"""The router's calls to the Kubernetes API (router/replicas.py, router/wake.py): bounded in time
against an API server that accepted the connection and went silent, and in a pod authenticated
with the service-account token as it is now, not as it was at start (the kubelet rotates it)."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscale.processes import free_port
from kvscale.router import replicas
from kvscale.router.metrics import RouterMetrics
from kvscale.router.wake import ScaleFromZero


@pytest.fixture
def silent_api_server(tmp_path: Path) -> Iterator[str]:
    """A kubeconfig whose API server accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", free_port()))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    yield str(kubeconfig)
    stop.set()
    listener.close()
    for conn in accepted:
        conn.close()


def test_waking_gives_up_on_a_silent_api_server(silent_api_server: str, monkeypatch) -> None:
    monkeypatch.setattr(replicas, "K8S_TIMEOUT_S", (0.3, 0.3))  # urllib3 retries a read timeout 3 times
    wake = ScaleFromZero("chat", "team", RouterMetrics(), kubeconfig=silent_api_server)
    outcome: list[BaseException | str] = []

    def call() -> None:
        try:
            outcome.append(wake._wake())
        except BaseException as exc:  # noqa: BLE001 - what ended the call is the assertion
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the call waits on the API server forever"
    assert "timed out" in str(outcome[0]).lower(), outcome


def test_the_endpointslice_watch_relists_after_a_silent_api_server(silent_api_server: str, monkeypatch,
                                                                    caplog) -> None:
    import asyncio

    monkeypatch.setattr(replicas, "K8S_TIMEOUT_S", (0.3, 0.3))  # urllib3 retries a read timeout 3 times
    loop = asyncio.new_event_loop()
    watch = replicas.EndpointSliceWatch("svc", "team", lambda urls: None, loop, kubeconfig=silent_api_server)
    with caplog.at_level(logging.WARNING, logger="kvscale.router.replicas"):
        watch.start()
        try:
            deadline = time.monotonic() + 10
            while "relisting" not in caplog.text:
                assert time.monotonic() < deadline, "the list waits on the API server forever"
                time.sleep(0.1)
        finally:
            watch.stop()
            loop.close()


def test_in_a_pod_the_rotated_token_is_sent(tmp_path: Path, monkeypatch) -> None:
    from kubernetes.config import incluster_config

    token, cert = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("first")
    cert.write_text("ca")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cert))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    configuration = replicas.kube_api_client().configuration
    assert configuration.get_api_key_with_prefix("BearerToken") == "bearer first"
    token.write_text("second")  # the kubelet rotated it

    class Later(datetime.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[override]
            return datetime.datetime.fromtimestamp(time.time() + 120, tz)

    monkeypatch.setattr(incluster_config.datetime, "datetime", Later)
    assert configuration.get_api_key_with_prefix("BearerToken") == "bearer second"
