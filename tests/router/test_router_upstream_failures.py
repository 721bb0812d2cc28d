"""A replica that breaks off, and a client that leaves, through the router (router/relay.py,
router/client_watch.py): the replica is a real HTTP server on loopback whose socket closes
mid-answer, as a SIGKILLed process's does; the router is its app with the gate and limits of
`kvscale router`, served by uvicorn."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from kvscale.processes import free_port
from kvscale.router.config import RouterConfig
from kvscale.router.relay import at_event_boundary

MODEL = "fake"
EVENT = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"x"}]}\n\n'


class Replica(BaseHTTPRequestHandler):
    """Answers by the prompt: how to break off. ``left`` is set once a client's connection
    to a replica that never answers ("hang") closed."""

    protocol_version = "HTTP/1.1"
    left = threading.Event()

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
        self._head(200, "application/json", len(body))
        self.wfile.write(body)

    def do_POST(self) -> None:
        how = json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"]
        if how == "hang":  # a long non-streaming generation: nothing until the client leaves
            self.connection.settimeout(30)
            if self.connection.recv(1) == b"":
                Replica.left.set()
            self.close_connection = True
            return
        if how == "json-cut":
            self._head(200, "application/json", 1000)
            self.wfile.write(b'{"id": "c", "choices": [{"text": "only the beg')
        else:
            self._head(200, "text/event-stream", None)
            parts = [EVENT] * 3 + ([b'data: {"id":"c","cho'] if how == "sse-mid-event" else [])
            for part in parts:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.flush()
        time.sleep(0.2)  # the router has relayed what came; then the process dies
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True

    def _head(self, status: int, content_type: str, length: int | None) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        if length is None:
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("content-length", str(length))
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def router(in_process_routers) -> Iterator[str]:
    replica = ThreadingHTTPServer(("127.0.0.1", free_port()), Replica)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    url = in_process_routers.start(RouterConfig(
        replicas=[f"http://127.0.0.1:{replica.server_address[1]}"], policy="round-robin",
        models=[], health_interval_s=0.5, max_attempts=1))
    deadline = time.monotonic() + 20
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the replica never became healthy behind the router"
        time.sleep(0.1)
    yield url
    replica.shutdown()
    replica.server_close()


def test_a_stream_broken_between_events_ends_with_an_error_event(router: str) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=20)
    texts = []
    with pytest.raises(openai.APIError, match="failed while answering") as caught:
        for chunk in client.completions.create(model=MODEL, prompt="sse-boundary", stream=True):
            texts.append(chunk.choices[0].text)
    assert texts == ["x"] * 3
    assert caught.value.body["code"] == "replica_failed"  # type: ignore[index]


def test_a_stream_broken_inside_an_event_aborts_the_connection(router: str) -> None:
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
            "POST", f"{router}/v1/completions", timeout=20,
            json={"model": MODEL, "prompt": "sse-mid-event", "stream": True}) as response:
        assert response.status_code == 200
        for _ in response.iter_bytes():
            pass


def test_a_json_answer_cut_short_is_never_a_short_200(router: str) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{router}/v1/completions", json={"model": MODEL, "prompt": "json-cut"}, timeout=20)


def test_a_client_that_leaves_before_the_first_byte_closes_the_replicas_request(router: str) -> None:
    Replica.left.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router}/v1/completions", json={"model": MODEL, "prompt": "hang"}, timeout=1.0)
    assert Replica.left.wait(5), "the replica kept the request of a client that left"
    metrics = httpx.get(f"{router}/metrics").text
    assert 'status="499"' in metrics


def test_event_boundaries() -> None:
    assert at_event_boundary(b"") and at_event_boundary(b"}\n\n") and at_event_boundary(b"\r\n\r\n")
    assert not at_event_boundary(b'"x"}\n') and not at_event_boundary(b"data")
