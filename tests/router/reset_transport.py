"""A transport that fails a connection as anyio does when the peer resets it as it is made."""

from __future__ import annotations

import httpx


class ResetAsMade(httpx.AsyncBaseTransport):
    """Loopback HTTP, except that connecting to ``reset_url`` fails as anyio fails when the peer
    resets the connection as it is made: an AttributeError, not an httpx error."""

    def __init__(self, reset_url: str) -> None:
        self.reset_host = httpx.URL(reset_url).netloc
        self.real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.netloc == self.reset_host:
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return await self.real.handle_async_request(request)

    async def aclose(self) -> None:
        await self.real.aclose()
