"""What one request may cost `kvscale serve` and `kvscale router`, on the real
processes: a body over the limit gets 413 before it is read (declared, or chunked as it arrives),
a body that trickles in gets 408, an oversized head is refused, and each process serves the
next request as before.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvscale.processes import free_port, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LIMITS = ["--max-request-body-bytes", "2048", "--request-body-timeout", "2",
          "--h11-max-incomplete-event-size", "8192"]


def start(name: str, args: list[str], ready_path: str, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen([sys.executable, "-m", "kvscale", *args, "--host", "127.0.0.1", "--port",
                             str(port), *LIMITS], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 300, interval=0.5, what=f"{name} up")
    return proc, port


@pytest.fixture(scope="module", params=["serve", "router"])
def process(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp_path = tmp_path_factory.mktemp(request.param)
    if request.param == "serve":
        proc, port = start("serve", ["serve", "--max-model-len", "128", "--num-gpu-blocks-override", "16"],
                           "/health", tmp_path)
    else:  # no replica behind it: every limit applies before routing
        proc, port = start("router", ["router", "--replicas", "http://127.0.0.1:9"], "/metrics", tmp_path)
    yield port
    proc.terminate()
    proc.wait(30)


def raw_exchange(port: int, head: bytes, body_parts: list[bytes], pause_s: float = 0.05) -> tuple[int, dict]:
    """Send a request by hand (chunked or trickled bodies, heads of any size); status and JSON.
    Sending stops once the answer arrives, as a client's would: a refused upload is not read."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head)
        for part in body_parts:
            if select.select([conn], [], [], pause_s)[0]:
                break  # answered before the body was whole
            try:
                conn.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        with contextlib.suppress(ConnectionResetError):
            while chunk := conn.recv(65536):
                data += chunk
    assert data, "no answer"
    status = int(data.split(b" ", 2)[1])
    payload = data.split(b"\r\n\r\n", 1)[1]
    return status, (json.loads(payload) if payload.startswith(b"{") else {})


def test_a_declared_body_over_the_limit_is_413_unread(process: int) -> None:
    body = json.dumps({"model": "m", "prompt": "x" * 4096, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    status, payload = raw_exchange(process, head, [])  # the body is never sent
    assert status == 413
    error = payload["error"]
    assert error["code"] == "request_too_large" and "--max-request-body-bytes" in error["message"]


def test_a_chunked_body_is_cut_off_at_the_limit(process: int) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 1000
    parts = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * 5 + [b"0\r\n\r\n"]
    status, payload = raw_exchange(process, head, parts)
    assert status == 413 and payload["error"]["code"] == "request_too_large"


def test_a_body_that_trickles_in_is_408(process: int) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    started = time.monotonic()
    status, payload = raw_exchange(process, head, [b"{"] * 5, pause_s=1.0)
    assert status == 408 and payload["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 10


def test_an_oversized_head_is_refused_and_the_next_request_served(process: int) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 16384 + b"\r\n\r\n"
    status, _ = raw_exchange(process, head, [])
    assert status in (400, 431)
    # Within the limits, the process answers as before.
    assert httpx.get(f"http://127.0.0.1:{process}/v1/models", timeout=10).status_code == 200
    small = httpx.post(f"http://127.0.0.1:{process}/v1/completions", timeout=60,
                       json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1})
    assert small.status_code == 404  # parsed and answered: no limit in the way
