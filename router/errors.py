"""The error body the router answers with itself: OpenAI's shape, so clients parse it as theirs."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


def openai_error(status: int, message: str, err_type: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": None, "code": code}},
        status_code=status,
    )


async def not_found(request: Request, exc: Exception) -> JSONResponse:
    """A path the router has no route for, in the error body clients parse (docs/router.md)."""
    path = request.url.path
    return openai_error(404, f"The router has no route {path[:200]!r}.", "invalid_request_error", "not_found")


def request_json(raw: bytes) -> dict[str, Any] | JSONResponse:
    """A generation request's JSON object, or the 400 refusing it: what the HTTP path and the
    endpoint picker both check before ranking (the replica checks the rest)."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
    except ValueError as exc:
        return openai_error(400, f"invalid JSON body: {exc}", "invalid_request_error")
    except RecursionError:  # the decoder's depth bound: a client's fault like any other bad JSON
        return openai_error(400, "invalid JSON body: nested too deeply", "invalid_request_error")
    if body.get("model") is not None and not isinstance(body["model"], str):
        return openai_error(400, "model must be a string", "invalid_request_error")
    return body
