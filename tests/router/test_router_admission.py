"""What the router lets in before it reads a body (router/admission.py): the key from the head,
a budget of body bytes over every open request, a bound on open requests; each refusal in
OpenAI's error JSON. Raw sockets against the router's app with the gate and limits of
`kvscale router`, served by uvicorn in this process."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
import pytest
from starlette.requests import Request

from kvscale.processes import free_port, wait_until
from kvscale.request_limits import RequestLimits
from kvscale.router import auth
from kvscale.router.admission import AdmissionLimits, refusal
from kvscale.router.config import RouterConfig

KEY = "sk-router-secret"
NOBODY = f"http://127.0.0.1:{free_port()}"  # a replica nobody listens on


@pytest.fixture(scope="module")
def keyed(in_process_routers) -> str:
    return in_process_routers.start(RouterConfig(replicas=[NOBODY], models=[], api_key=KEY,
                                                 policy="round-robin"))


@pytest.fixture(scope="module")
def bounded(in_process_routers) -> str:
    config = RouterConfig(replicas=[NOBODY], models=[], policy="round-robin",
                          max_open_requests=3, body_budget_bytes=100_000)
    return in_process_routers.start(config, RequestLimits(max_body_bytes=64_000))


@pytest.fixture
def settled(in_process_routers, bounded: str) -> Callable[[int, int], None]:
    """Waits until the bounded router's gate counts ``open_requests`` and ``held_bytes``: what the
    client sent reaches it (or a close frees it) when the server's thread gets to it, later on a
    busy machine; a count that never gets there (a leak) fails the wait."""
    admission = in_process_routers.gates[bounded]

    def wait(open_requests: int, held_bytes: int) -> None:
        wait_until(lambda: (admission.open_requests, admission.held_bytes) == (open_requests, held_bytes),
                   10, interval=0.01,
                   what=f"{open_requests} open, {held_bytes} bytes held (now {admission.open_requests}, "
                        f"{admission.held_bytes})")
    return wait


def connect(base: str) -> socket.socket:
    port = int(base.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def head(length: int | None, key: str | None = None, path: str = "/v1/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: router", "content-type: application/json"]
    lines.append("transfer-encoding: chunked" if length is None else f"content-length: {length}")
    if key:
        lines.append(f"authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(conn: socket.socket) -> tuple[int, dict[str, str], dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = conn.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    top, body = data.split(b"\r\n\r\n", 1)
    lines = top.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def test_the_key_is_checked_from_the_head_before_any_body_byte(keyed: str) -> None:
    with connect(keyed) as conn:
        started = time.monotonic()
        conn.sendall(head(30 * 2**20) + b"x" * 2**16)  # announces 30 MiB, sends 64 KiB of it
        status, headers, body = answer(conn)  # read before the body would have been: 10 s timeout
    assert status == 401 and time.monotonic() - started < 5
    assert body["error"]["code"] == "invalid_api_key" and headers["connection"] == "close"


def test_with_a_key_nothing_but_the_probes_is_open(keyed: str) -> None:
    for path in ("/docs", "/openapi.json", "/v1/models", "/version"):
        assert httpx.get(f"{keyed}{path}").status_code == 401, path
    assert httpx.get(f"{keyed}/metrics").status_code == 200
    assert httpx.get(f"{keyed}/ping").status_code == 200
    assert httpx.get(f"{keyed}/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_bodies_held_past_the_budget_are_503_with_retry_after(bounded: str, settled) -> None:
    with connect(bounded) as announcer:
        announcer.sendall(head(60_000))  # announced, never sent: reserves nothing
        with connect(bounded) as holder:
            holder.sendall(head(61_000) + b"{" * 60_000)  # 60 kB arrived, the rest never comes
            settled(2, 60_000)
            with connect(bounded) as refused:
                refused.sendall(head(60_000))
                status, headers, body = answer(refused)
            assert status == 503 and headers["retry-after"] == "1"
            error = body["error"]
            assert error["code"] == "overloaded" and "--max-body-bytes-in-flight" in error["message"]
            # A chunked body is counted as it arrives: 30 kB fit beside the 60, 60 kB do not.
            with connect(bounded) as chunked:
                chunked.sendall(head(None))
                part = b"x" * 30_000
                for _ in range(2):
                    chunked.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                status, _, body = answer(chunked)
            assert status == 503 and body["error"]["code"] == "overloaded"
        # The holder gone, its bytes are free again: the same body is let in (and routed: no
        # replica), beside the announcer, still open.
        settled(1, 0)
        response = httpx.post(f"{bounded}/v1/completions", content=b'{"prompt": "' + b"x" * 59_000 + b'"}')
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert response.json()["error"]["code"] != "overloaded"


def test_open_requests_past_the_bound_are_503(bounded: str, settled) -> None:
    conns = [connect(bounded) for _ in range(3)]
    try:
        for conn in conns:
            conn.sendall(head(10))  # open: their bodies never come
        settled(3, 0)
        response = httpx.post(f"{bounded}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
        assert "--max-open-requests" in response.json()["error"]["message"]
        assert httpx.get(f"{bounded}/health").status_code in (200, 503)  # probes are never refused
        assert httpx.get(f"{bounded}/ping").status_code == 200
    finally:
        for conn in conns:
            conn.close()
    settled(0, 0)
    assert httpx.post(f"{bounded}/v1/completions", json={"prompt": "x"}).json()["error"]["code"] != "overloaded"


def test_refusals_in_order() -> None:
    limits = AdmissionLimits(api_key=KEY, max_open_requests=2, body_budget_bytes=100, max_body_bytes=80)
    ok = {"key_ok": True, "open_requests": 0, "held_bytes": 0, "declared_bytes": 50}
    assert refusal(limits, **ok) is None
    assert refusal(limits, **{**ok, "key_ok": False}).status == 401  # type: ignore[union-attr]
    assert refusal(limits, **{**ok, "open_requests": 2}).status == 503  # type: ignore[union-attr]
    assert refusal(limits, **{**ok, "held_bytes": 60}).status == 503  # type: ignore[union-attr]
    # Larger than one body may be: the body limits answer it 413, not the budget.
    assert refusal(limits, **{**ok, "held_bytes": 60, "declared_bytes": 90}) is None


def test_the_key_comparison_does_not_tell_the_keys_length(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[int, int]] = []
    real = auth.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    for token in ("s", "sk-router-secret-and-more", KEY):
        scope = {"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]}
        auth.check_api_key(Request(scope), KEY)
    assert compared and all(a == b for a, b in compared), compared
