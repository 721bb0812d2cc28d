"""Request bodies read as strict JSON, by msgspec.

Starlette reads a JSON body with ``json.loads``, which takes ``NaN`` and ``Infinity``: not JSON,
and refused by OpenAI's API. A ``NaN`` inside a schema would reach the grammar as a constraint no
JSON value meets, or as ``null`` wherever the schema is written out again. msgspec refuses them,
and reads a body about twice as fast: a request with a ~190 KB schema took the event loop
2.1 ms to parse with ``json.loads`` and 0.96 ms with msgspec (``python -m bench.request_intake``),
time in which the front end streams nothing and takes a core from the engine's threads
(docs/performance.md, "Structured outputs").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


def loads(text: str | bytes) -> Any:
    """Strict JSON to Python values; ``json.JSONDecodeError`` (FastAPI's 'JSON decode error') if not."""
    try:
        return _DECODER.decode(text)
    except msgspec.DecodeError as exc:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError(str(exc), doc, 0) from exc
    except RecursionError as exc:  # msgspec's depth bound: bad JSON from the client, not a 500
        raise json.JSONDecodeError("nested too deeply", "", 0) from exc


def dumps_compact(value: Any) -> str:
    """Compact JSON, keys in their order, non-ASCII kept (values from ``loads`` are all finite)."""
    return _ENCODER.encode(value).decode()


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose handler reads its body with ``StrictJSONRequest`` (FastAPI's documented way
    to change how a route reads its request)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def read_strictly(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return read_strictly
