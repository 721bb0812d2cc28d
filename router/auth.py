"""The client's API key: a Bearer token compared in constant time."""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvscale.router.errors import openai_error


def check_api_key(request: Request, api_key: str | None) -> JSONResponse | None:
    """None when the request may pass (or no key is set), else the 401 to answer with."""
    if not api_key:
        return None
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if hmac.compare_digest(token.encode(), api_key.encode()):
        return None
    return openai_error(
        401, "invalid or missing API key", "authentication_error", "invalid_api_key")
