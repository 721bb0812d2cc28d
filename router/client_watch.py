"""Watching the client while a replica works on its request, before the first byte comes back.

A non-streaming request's first byte is its whole answer: until then nothing is sent, so a
client that left is noticed only by listening. When it leaves, the forwarding is cancelled,
which closes the connection to the replica, and the replica aborts the request and frees its
KV blocks at once instead of generating to the end (docs/router.md, "Failures"). After the
first byte, the streamed response itself listens (Starlette cancels it on a disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

from starlette.responses import Response

# nginx's "client closed request": nobody reads it; it names the outcome in the metrics.
CLIENT_GONE = 499


def disconnect_of(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> Callable[[], Awaitable[None]]:
    """What returns once the client has disconnected, given the request's ASGI ``receive`` after
    its body was read (the next message can only be the disconnect)."""

    async def wait() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return wait


async def unless_client_leaves(work: Coroutine[Any, Any, Response],
                               client_left: Callable[[], Awaitable[None]] | None) -> Response:
    """``work``'s response, or (the client left first) ``work`` cancelled and a 499."""
    if client_left is None:
        return await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(client_left())
    left = True
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = not task.done()
        watch.cancel()
        if left:
            task.cancel()  # in the replica's hands: closing the connection aborts it there
        for waited in (watch, task) if left else (watch,):
            with contextlib.suppress(asyncio.CancelledError):
                await waited
    if left:
        return Response(status_code=CLIENT_GONE)
    return task.result()
