"""One connection to Redis with its commands pipelined: what the router sends on a request's path
(a tenant's admission script: router/tenant_limiter.py), kept to the fewest steps.

redis-py's asyncio client takes a pooled connection, checks it, wraps the call in its retries
and parses RESP3 for every command; with ``asyncio.wait_for`` around it, one admission was about
650 Python calls and six turns of the event loop (cProfile), each slow on a router whose caches
went cold between requests. Here a command is written on the one connection and its future is
resolved where the reply is read: about 190 calls for the whole admission and two turns. Replies come
in the order the commands were written, so concurrent callers share the connection without
waiting for each other.

Plain ``redis://`` and ``unix://`` URLs (with a user, a password and a database); the others
(``rediss://``, connection options in the query) keep redis-py's client behind the same two
calls (``open_redis``). A reply that does not come within the call's timeout fails it and closes
the connection (the next call opens another), so a Redis that hangs holds no backlog.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, cast

# redis.connection.parse_url's keys that a plain connection honours; any other (TLS, options in
# the query) leaves the URL to redis-py.
_PLAIN_KEYS = frozenset({"host", "port", "db", "username", "password", "path"})
# A reply larger than this is no answer to the scripts sent here: the connection is dropped.
MAX_REPLY_BYTES = 1 << 20


class ReplyError(Exception):
    """Redis answered the command with an error (``-ERR ...``, ``-NOSCRIPT ...``)."""


@dataclass(frozen=True)
class Endpoint:
    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket's
    db: int = 0
    username: str | None = None
    password: str | None = None


def lean_url(url: str) -> Endpoint | None:
    """Where a ``redis://`` or ``unix://`` URL points, or None when it needs redis-py's client."""
    from redis.connection import parse_url

    try:
        parts = parse_url(url)
    except ValueError:
        return None
    if url.startswith("unix://"):
        parts.pop("connection_class", None)  # the unix socket's, which ``path`` says here
    if set(parts) - _PLAIN_KEYS:
        return None
    return Endpoint(str(parts.get("host") or "localhost"), int(parts.get("port") or 6379),
                    parts.get("path"), int(parts.get("db") or 0), parts.get("username"),
                    parts.get("password"))


def encode(*args: str | bytes | int | float) -> bytes:
    """A command as RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def parse_reply(buffer: bytes | bytearray, pos: int = 0) -> tuple[Any, int] | None:
    """The RESP2 reply starting at ``pos`` and where it ends, or None while it is incomplete.
    Simple strings and bulk strings are bytes, nil is None, an error reply a ReplyError (returned,
    not raised: it answers one command, the connection is fine)."""
    end = buffer.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, line = buffer[pos:pos + 1], bytes(buffer[pos + 1:end])
    pos = end + 2
    if kind == b":":
        return int(line), pos
    if kind == b"+":
        return line, pos
    if kind == b"-":
        return ReplyError(line.decode(errors="replace")), pos
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, pos
        if len(buffer) < pos + size + 2:
            return None
        return bytes(buffer[pos:pos + size]), pos + size + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item = parse_reply(buffer, pos)
            if item is None:
                return None
            items.append(item[0])
            pos = item[1]
        return items, pos
    raise ValueError(f"not a RESP2 reply: {bytes(buffer[pos - len(line) - 3:end])[:64]!r}")


class _Replies(asyncio.Protocol):
    """The connection: commands written, each one's future resolved as its reply is read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no asyncio.Transport subclasses, though they are one in kind.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, command: bytes) -> asyncio.Future[Any]:
        assert self.transport is not None
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(command)
        return future

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        pos = 0
        try:
            while (parsed := parse_reply(self.buffer, pos)) is not None:
                value, pos = parsed
                if not self.waiting:
                    raise ValueError("a reply to no command")
                future = self.waiting.popleft()
                if future.done():  # its caller gave up (timed out, cancelled)
                    continue
                if isinstance(value, ReplyError):
                    future.set_exception(value)
                else:
                    future.set_result(value)
        except ValueError as exc:
            self.abort(ConnectionError(f"Redis sent what this client cannot read: {exc}"))
            return
        del self.buffer[:pos]
        if len(self.buffer) > MAX_REPLY_BYTES:
            self.abort(ConnectionError(f"a reply from Redis over {MAX_REPLY_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"the connection to Redis was lost: {exc or 'closed'}"))

    def abort(self, exc: Exception) -> None:
        self.closed = True
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)


class RedisPipe:
    """Commands to one Redis over one connection, opened on first use and again after it was lost.
    Every call is bounded by ``timeout_s`` (opening the connection included)."""

    def __init__(self, endpoint: Endpoint, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._conn: _Replies | None = None
        self._opening: asyncio.Future[_Replies] | None = None
        self._shas: dict[str, str] = {}

    async def execute(self, *args: str | bytes | int | float) -> Any:
        """The command's reply; ReplyError when Redis answers an error, ConnectionError or
        TimeoutError when it does not answer."""
        return await self._send(encode(*args))

    async def run_script(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """``script``'s reply, by its SHA-1 (EVALSHA); a Redis that does not hold it (restarted,
        flushed) gets its text once (EVAL, which keeps it)."""
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        try:
            return await self._send(encode("EVALSHA", sha, len(keys), *keys, *args))
        except ReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self._send(encode("EVAL", script, len(keys), *keys, *args))

    async def _send(self, command: bytes) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        conn = self._conn
        if conn is None or conn.closed:
            conn = await asyncio.wait_for(self._open(), self.timeout_s)
        future = conn.send(command)
        timer = loop.call_at(deadline, self._expire, conn, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, conn: _Replies, future: asyncio.Future[Any]) -> None:
        if not future.done():
            future.set_exception(TimeoutError(f"Redis did not answer within {self.timeout_s:g} s"))
            conn.abort(ConnectionError("closed after a reply did not come in time"))
            if self._conn is conn:
                self._conn = None

    async def _open(self) -> _Replies:
        """The connection, opened once for every caller waiting on it."""
        if self._opening is None or self._opening.done():
            # Bounded on its own: callers that gave up leave it to finish or fail, never to hang.
            self._opening = asyncio.ensure_future(asyncio.wait_for(self._connect(), self.timeout_s))
            self._opening.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._opening)

    async def _connect(self) -> _Replies:
        loop = asyncio.get_running_loop()
        where = self.endpoint
        if where.path is not None:
            _, conn = await loop.create_unix_connection(_Replies, where.path)
        else:
            _, conn = await loop.create_connection(_Replies, where.host, where.port)
        try:
            handshake = []
            if where.password is not None:
                user = [where.username] if where.username else []
                handshake.append(encode("AUTH", *user, where.password))
            if where.db:
                handshake.append(encode("SELECT", where.db))
            for command in handshake:
                await conn.send(command)
        except BaseException:
            conn.abort(ConnectionError("handshake failed"))
            raise
        self._conn = conn
        return conn

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if conn is not None and conn.transport is not None:
            conn.transport.close()


class RedisPyClient:
    """The same calls through redis-py's asyncio client: for the URLs RedisPipe does not take."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import redis.asyncio as aioredis

        self.timeout_s = timeout_s
        # Each socket operation gets half the call's time, as the callers' own bounds had it.
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout_s / 2,
                                               socket_connect_timeout=timeout_s / 2)
        self._scripts: dict[str, Any] = {}

    async def execute(self, *args: str | bytes | int | float) -> Any:
        return await asyncio.wait_for(self._client.execute_command(*args), self.timeout_s)

    async def run_script(self, script: str, keys: list[str], args: list[Any]) -> Any:
        registered = self._scripts.get(script)
        if registered is None:
            registered = self._scripts[script] = self._client.register_script(script)
        return await asyncio.wait_for(registered(keys=keys, args=args), self.timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()


class RedisCalls(Protocol):
    async def execute(self, *args: str | bytes | int | float) -> Any: ...

    async def run_script(self, script: str, keys: list[str], args: list[Any]) -> Any: ...

    async def aclose(self) -> None: ...


def open_redis(url: str, timeout_s: float) -> RedisCalls:
    """The calls to the Redis at ``url``, each bounded by ``timeout_s``: one pipelined connection
    where the URL allows, else redis-py's client. Nothing is opened before the first call."""
    endpoint = lean_url(url)
    return RedisPipe(endpoint, timeout_s) if endpoint is not None else RedisPyClient(url, timeout_s)
