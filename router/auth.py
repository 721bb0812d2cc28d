"""The client's API key: a Bearer token compared in constant time, its length included.

Both sides are hashed first (SHA-256), so ``hmac.compare_digest`` always compares 32 bytes:
comparing the raw strings would end early on a length mismatch and tell the key's length.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvscale.router.errors import openai_error


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_digest(authorization: str) -> bytes:
    """The digest of the key an Authorization header's value carries (``Bearer <key>``); a
    header of another form gives the empty key's, which no key matches."""
    return key_digest(authorization[7:] if authorization.lower().startswith("bearer ") else "")


def bearer_matches(authorization: str, digest: bytes) -> bool:
    """Whether an Authorization header's value is ``Bearer <the key>``."""
    return hmac.compare_digest(bearer_digest(authorization), digest)


def check_api_key(request: Request, api_key: str | None) -> JSONResponse | None:
    """None when the request may pass (or no key is set), else the 401 to answer with."""
    if not api_key or bearer_matches(request.headers.get("authorization", ""), key_digest(api_key)):
        return None
    return openai_error(
        401, "invalid or missing API key", "authentication_error", "invalid_api_key")
