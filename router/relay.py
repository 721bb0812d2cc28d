"""A committed response whose replica breaks off: what the client gets instead of a clean end.

Once the first byte went to the client the status and headers are sent and the request cannot
move to another replica. A replica that dies or stalls past the read timeout after that must
still not look like success (docs/router.md, "Failures"):

- an event stream cut between two events gets one more event, ``event: error`` with OpenAI's
  error JSON as its data, and ends there (no ``[DONE]``): OpenAI's clients raise it;
- anything else (a JSON body, or a stream cut inside an event, where an appended event would
  be read as part of the cut one) ends with the connection aborted: the final chunk of the
  chunked body is never sent, so the client reads an incomplete body, never a short 200.
"""

from __future__ import annotations

import json

from starlette.responses import StreamingResponse
from starlette.types import Send


class UpstreamBroke(Exception):
    """Raised by a relayed body whose replica broke off where no error event can be added."""


def error_event(message: str) -> bytes:
    """The SSE event that tells a streaming client its answer broke off."""
    body = {"error": {"message": message, "type": "bad_gateway", "param": None,
                      "code": "replica_failed"}}
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


def at_event_boundary(tail: bytes) -> bool:
    """Whether a stream whose last bytes are ``tail`` ends between two SSE events (a blank
    line), or before any: the only places another event may start."""
    return tail == b"" or tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r"))


class RelayResponse(StreamingResponse):
    """A streamed passthrough that can end aborted: ``UpstreamBroke`` from the body leaves the
    response incomplete, and the server then closes the connection (uvicorn does)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        except UpstreamBroke:
            return
