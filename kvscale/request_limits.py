"""What one HTTP request may cost `kvscale serve` and `kvscale router` before any handler runs:
its body's size and the time its client takes to send it, and the size of its head; and, for
`kvscale serve`, what its fields may ask of the engine (``FieldLimits``, docs/server.md "Request
limits").

Both read every body whole to parse its JSON, so the body is read here first, into memory only
up to ``max_body_bytes``: a larger one (by its Content-Length, or as it arrives when chunked) is
answered 413, one that trickles in longer than ``body_timeout_s`` 408, both with the OpenAI error
JSON and the connection closed. The handler then reads the same bytes as if from the client.
An app that sets ``state.before_body`` (the API key check) has it run on the request's head
before a byte of the body is read: a client without the key cannot make the process hold a body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # a 128k-token prompt as token ids is ~1 MB
DEFAULT_BODY_TIMEOUT_S = 60.0
# h11's own default, spelled out: the request line and headers together.
DEFAULT_MAX_HEAD_BYTES = 16 * 1024


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get 413 before they are read "
                             f"(default {DEFAULT_MAX_BODY_BYTES // 2**20} MiB)")
    parser.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        metavar="SECONDS",
                        help="a body not received whole within this gets 408 "
                             f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--h11-max-incomplete-event-size", type=int, default=DEFAULT_MAX_HEAD_BYTES,
                        help="bytes of request line and headers beyond which the request is refused "
                             f"(default {DEFAULT_MAX_HEAD_BYTES})")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The limits the flags give; SystemExit naming the flag for a value that cannot work."""
    for flag, value in (("--max-request-body-bytes", args.max_request_body_bytes),
                        ("--request-body-timeout", args.request_body_timeout),
                        ("--h11-max-incomplete-event-size", args.h11_max_incomplete_event_size)):
        if value <= 0:
            raise SystemExit(f"{flag} must be positive, got {value}")
    return RequestLimits(args.max_request_body_bytes, args.request_body_timeout,
                         args.h11_max_incomplete_event_size)


def error_response_parts(status: int, message: str, code: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    # The rest of the body is never read: the connection cannot carry another request.
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")], body


# ------------------------------------------------------------------ what a request's fields may ask

# Defaults: OpenAI's own caps where it has one (128 tools, 1024 logit_bias entries), else bounds
# no real client meets that keep one request's cost on the wire, in the core and per token small
# (docs/server.md "Request limits").
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 2048  # prompts x n
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_LENGTH = 512  # characters
DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_LOGIT_BIAS = 1024
DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES = 512 * 1024  # a schema, regex, grammar or all choices
DEFAULT_MAX_TOOLS = 128
# Waiting sequences: room for two of the largest requests; a deeper queue only adds waiting a
# client would rather spend on another replica (the router retries a 503 elsewhere).
DEFAULT_MAX_QUEUE_LEN = 2 * DEFAULT_MAX_SEQUENCES_PER_REQUEST


@dataclass(frozen=True)
class FieldLimits:
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_length: int = DEFAULT_MAX_STOP_STRING_LENGTH
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_structured_output_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES
    max_tools: int = DEFAULT_MAX_TOOLS


_FIELD_FLAGS = (
    ("max_sequences_per_request", "prompts times n one request may start"),
    ("max_stop_strings", "stop strings one request may give"),
    ("max_stop_string_length", "characters of one stop string"),
    ("max_stop_token_ids", "stop_token_ids one request may give"),
    ("max_logit_bias", "logit_bias entries one request may give"),
    ("max_structured_output_bytes", "bytes of one request's JSON schema, regex, grammar or choices "
                                    "(tools: of the grammar they make)"),
    ("max_tools", "tools one chat request may declare"),
)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_field_arguments(parser: argparse.ArgumentParser | Any) -> None:
    defaults = FieldLimits()
    for name, what in _FIELD_FLAGS:
        parser.add_argument(flag(name), type=int, default=getattr(defaults, name),
                            help=f"{what}; more get 400 (default {getattr(defaults, name)})")


def field_limits_from_args(args: argparse.Namespace) -> FieldLimits:
    """SystemExit naming the flag for a value below 1."""
    values = {name: getattr(args, name) for name, _ in _FIELD_FLAGS}
    for name, value in values.items():
        if value < 1:
            raise SystemExit(f"{flag(name)} must be at least 1, got {value}")
    return FieldLimits(**values)


class LimitExceeded(ValueError):
    """A request over one of ``FieldLimits``: its message names the limit and its flag."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _over(limit_name: str, limits: FieldLimits, count: int, what: str, param: str) -> LimitExceeded:
    limit = getattr(limits, limit_name)
    return LimitExceeded(f"This request has {count} {what}; this server takes at most {limit} "
                         f"({flag(limit_name)}).", param)


def check_sequences(limits: FieldLimits, prompts: int, n: int) -> None:
    if prompts * n > limits.max_sequences_per_request:
        raise _over("max_sequences_per_request", limits, prompts * n,
                    f"sequences ({prompts} prompts times n={n})", "n" if prompts == 1 else "prompt")


def check_sampling_fields(limits: FieldLimits, *, stop: list[str], stop_token_ids: int,
                          logit_bias: int, tools: int) -> None:
    """Counts of the request-wide fields, checked before any is parsed or copied."""
    if len(stop) > limits.max_stop_strings:
        raise _over("max_stop_strings", limits, len(stop), "stop strings", "stop")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_string_length:
        raise _over("max_stop_string_length", limits, longest, "characters in a stop string", "stop")
    if stop_token_ids > limits.max_stop_token_ids:
        raise _over("max_stop_token_ids", limits, stop_token_ids, "stop_token_ids", "stop_token_ids")
    if logit_bias > limits.max_logit_bias:
        raise _over("max_logit_bias", limits, logit_bias, "logit_bias entries", "logit_bias")
    if tools > limits.max_tools:
        raise _over("max_tools", limits, tools, "tools", "tools")


def check_structured_bytes(limits: FieldLimits, size: int, param: str) -> None:
    if size > limits.max_structured_output_bytes:
        raise _over("max_structured_output_bytes", limits, size, "bytes of structured-output "
                    "constraint", param)


# ------------------------------------------------------------------ the body, before any handler


class BodyTooLarge(Exception):
    pass


class RequestLimitMiddleware:
    """Plain ASGI, outermost: reads each request's body within the limits, then runs the app."""

    def __init__(self, app: Any, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        before_body = getattr(getattr(self.app, "state", None), "before_body", None)
        refusal = before_body(scope) if before_body is not None else None
        if refusal is not None:  # an ASGI response, sent before a byte of the body is read
            await refusal(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        try:
            if declared is not None and int(declared) > limit:
                raise BodyTooLarge
            body, disconnected = await asyncio.wait_for(self._read_body(receive, limit),
                                                        self.limits.body_timeout_s)
        except BodyTooLarge:
            await self._refuse(send, 413, f"The request body is larger than this server takes "
                               f"({limit} bytes, --max-request-body-bytes).", "request_too_large")
            return
        except TimeoutError:
            await self._refuse(send, 408, f"The request body did not arrive within "
                               f"{self.limits.body_timeout_s:g} s (--request-body-timeout).",
                               "request_timeout")
            return
        except ValueError:  # a Content-Length that is no number: h11 refuses it before us
            await self._refuse(send, 400, "Invalid Content-Length.", "invalid_request")
            return
        if disconnected:
            return
        await self.app(scope, self._replay(body, receive), send)

    @staticmethod
    async def _read_body(receive: Any, limit: int) -> tuple[bytes, bool]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    @staticmethod
    def _replay(body: bytes, receive: Any) -> Any:
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        return replay

    @staticmethod
    async def _refuse(send: Any, status: int, message: str, code: str) -> None:
        headers, body = error_response_parts(status, message, code)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def http_protocol() -> Any:
    """uvicorn's HTTP protocol with the head bounded by ``h11_max_incomplete_event_size``: h11
    bounds it itself; httptools (uvicorn's faster parser, used when installed) does not, and
    buffers a header of any size, so its protocol is wrapped to count."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHeadProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._in_head = True
            self._tail = b""  # the last bytes seen, for an end of head split between reads

        def data_received(self, data: bytes) -> None:
            limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_HEAD_BYTES
            if self._in_head:
                window = self._tail + data
                end = window.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
                if self._head_bytes > limit:
                    headers, body = error_response_parts(
                        431, "The request line and headers are larger than this server takes "
                        f"({limit} bytes, "
                        "--h11-max-incomplete-event-size).", "request_header_too_large")
                    head = b"HTTP/1.1 431 Request Header Fields Too Large\r\n" + b"".join(
                        name + b": " + value + b"\r\n" for name, value in headers)
                    self.transport.write(head + b"\r\n" + body)
                    self.transport.close()
                    return
                self._in_head = end < 0
                self._tail = window[-3:]
            super().data_received(data)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes, self._tail = True, 0, b""

    return BoundedHeadProtocol
