"""bench.common.streamed_completion, read against a real HTTP server on loopback: a failure
counts as begun only once a byte of a 200 answer has arrived (an error answer is no stream)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.common import StreamOutcome, streamed_completion
from kvscale.processes import free_port


class Answers(BaseHTTPRequestHandler):
    """/whole streams two events and [DONE]; /cut one event, then closes; /refused is a 503."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/refused":
            body = b'{"error": {"message": "no healthy upstream"}}'
            self.send_response(503)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("x-kvscale-replica", "replica-7")
        self.end_headers()
        events = [b"data: {}\n\n"] + ([b"data: {}\n\n", b"data: [DONE]\n\n"] if self.path == "/whole" else [])
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        if self.path == "/whole":
            self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_whole_cut_and_refused_answers() -> None:
    body = {"prompt": "x", "stream": True}
    with ThreadingHTTPServer(("127.0.0.1", free_port()), Answers) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        try:
            whole, cut, refused = (streamed_completion(f"{url}/{path}", body, 10) for path in ("whole", "cut", "refused"))
        finally:
            httpd.shutdown()
    assert whole == StreamOutcome(True, True, "replica-7")
    assert cut == StreamOutcome(False, True, "replica-7")
    assert refused == StreamOutcome(False, False, "")
