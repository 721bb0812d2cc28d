"""The in-cluster service-account token is a file the kubelet rotates: the operator's client
reads it again, so a rotated token never leaves it answering 401 until a restart."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvscale.operator.kube import ApiError, Connection, Kube


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An API server accepting only the token the file holds now."""
    token_file = tmp_path / "token"
    token_file.write_text("first\n")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            ok = self.headers.get("Authorization") == f"Bearer {token_file.read_text().strip()}"
            body = json.dumps({"kind": "Namespace"} if ok else
                              {"kind": "Status", "reason": "Unauthorized", "message": "bad token"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", token_file
    server.shutdown()
    server.server_close()


def test_a_rotated_token_file_is_read_again(api: tuple[str, Path]) -> None:
    url, token_file = api
    connection = Connection(server=url, ca_path=None, insecure=True, cert_path=None, key_path=None,
                            token="Bearer first", token_file=str(token_file))
    kube = Kube(connection)
    try:
        assert kube.get("/api/v1/namespaces/default") == {"kind": "Namespace"}
        token_file.write_text("second\n")  # the kubelet rotated it
        assert kube.get("/api/v1/namespaces/default") == {"kind": "Namespace"}
        assert connection.current_token() == "second"
    finally:
        kube.close()


def test_a_fixed_token_stays_as_given(api: tuple[str, Path]) -> None:
    url, token_file = api
    kube = Kube(Connection(server=url, ca_path=None, insecure=True, cert_path=None, key_path=None,
                           token="Bearer first"))
    try:
        assert kube.get("/api/v1/namespaces/default") == {"kind": "Namespace"}
        token_file.write_text("second\n")
        with pytest.raises(ApiError, match="401"):
            kube.get("/api/v1/namespaces/default")
    finally:
        kube.close()
