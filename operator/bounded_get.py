"""GET with bounds a hostile pod cannot stretch: the operator reads the /metrics of every
replica and the /health of every router it serves, in namespaces whose pods anyone may run.

httpx's timeout is per read, so a body dripped one byte per second never times out, and a
response is read whole, however large. Here the body is streamed: over ``max_bytes`` (announced
or received) it is refused; past ``deadline_s`` from the request's start it is abandoned. The
check runs between reads, so a scrape ends within ``deadline_s`` plus one read timeout
(docs/operator.md, "Scraping").
"""

from __future__ import annotations

import time

import httpx

DEFAULT_MAX_BYTES = 4 * 1024 * 1024  # a server's /metrics is tens of KiB; a router's /health less


class BoundExceeded(Exception):
    """The response broke a bound: too large, or too slow as a whole."""


def bounded_get(client: httpx.Client, url: str, max_bytes: int,
                deadline_s: float) -> tuple[int, bytes]:
    """(status, body) of GET ``url``; raises BoundExceeded, or httpx's errors."""
    started = time.monotonic()
    with client.stream("GET", url) as response:
        announced = response.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > max_bytes:
            raise BoundExceeded(f"body of {int(announced)} bytes over the {max_bytes}-byte cap")
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise BoundExceeded(f"body over the {max_bytes}-byte cap")
            if time.monotonic() - started > deadline_s:
                raise BoundExceeded(f"no whole answer within {deadline_s:g} s")
        return response.status_code, bytes(body)
