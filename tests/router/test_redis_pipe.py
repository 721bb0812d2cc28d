"""The router's pipelined Redis connection (router/redis_pipe.py): replies read whole, plain URLs
on the pipe and the others on redis-py, and on a real redis-server: scripts by SHA, concurrent
callers, a password and a database, a Redis that does not answer or goes away."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
import uuid

import pytest
import redis

from kvscale.processes import free_port, wait_for_port
from kvscale.router.redis_pipe import (
    Endpoint,
    RedisPipe,
    RedisPyClient,
    ReplyError,
    encode,
    lean_url,
    open_redis,
    parse_reply,
)
from kvscale.router.tenants import Tenant

SCRIPT = "return {ARGV[1], tonumber(ARGV[2]) + 1, redis.call('INCR', ARGV[3])}"


def test_a_reply_is_read_whole_or_not_at_all() -> None:
    reply = b"*5\r\n$0\r\n\r\n:7\r\n$3\r\nabc\r\n*2\r\n+OK\r\n$-1\r\n*-1\r\n"
    assert parse_reply(reply) == ([b"", 7, b"abc", [b"OK", None], None], len(reply))
    for cut in range(len(reply)):
        assert parse_reply(reply[:cut]) is None, cut
    error, end = parse_reply(b"-NOSCRIPT No matching script\r\n:1\r\n")  # type: ignore[misc]
    assert isinstance(error, ReplyError) and str(error).startswith("NOSCRIPT") and end == 30
    assert parse_reply(b"-NOSCRIPT No matching script\r\n:1\r\n", end) == (1, 34)
    with pytest.raises(ValueError):
        parse_reply(b"%1\r\n")  # RESP3: never asked for


def test_a_command_is_an_array_of_bulk_strings() -> None:
    assert encode("EVALSHA", "ab", 0, -3, 1.5, b"\xff") == (
        b"*6\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n0\r\n$2\r\n-3\r\n$3\r\n1.5\r\n$1\r\n\xff\r\n")


def test_plain_urls_take_the_pipe_and_the_others_redis_py() -> None:
    assert lean_url("redis://127.0.0.1:6390/0") == Endpoint("127.0.0.1", 6390)
    assert lean_url("redis://u:p@h/3") == Endpoint("h", 6379, None, 3, "u", "p")
    assert lean_url("redis://:p@h:1") == Endpoint("h", 1, password="p")
    assert lean_url("unix:///run/redis.sock?db=2") == Endpoint(path="/run/redis.sock", db=2)
    # TLS, and connection options in the query, are redis-py's to honour.
    for url in ("rediss://h:6380/0", "redis://h?socket_keepalive=true", "http://h"):
        assert lean_url(url) is None, url
    assert isinstance(open_redis("redis://127.0.0.1:1/0", 1.0), RedisPipe)
    assert isinstance(open_redis("rediss://127.0.0.1:1/0", 1.0), RedisPyClient)


def _commands(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(stats["calls"])
            for name, stats in client.info("commandstats").items()}


def test_a_script_runs_by_its_sha_and_is_sent_again_when_redis_lost_it(session_redis) -> None:
    client = redis.Redis.from_url(session_redis.url)
    key = f"pipe-{uuid.uuid4().hex}"

    async def run() -> list[object]:
        pipe = RedisPipe(lean_url(session_redis.url), 2.0)  # type: ignore[arg-type]
        try:
            first = await pipe.run_script(SCRIPT, [], ["a", 1, key])
            before = _commands(client)
            second = await pipe.run_script(SCRIPT, [], ["b", 2, key])
            after = _commands(client)
            client.script_flush()
            third = await pipe.run_script(SCRIPT, [], ["c", 3, key])
            assert after.get("evalsha", 0) - before.get("evalsha", 0) == 1
            assert after.get("eval", 0) == before.get("eval", 0)  # one round trip, by SHA
            return [first, second, third]
        finally:
            await pipe.aclose()

    assert asyncio.run(run()) == [[b"a", 2, 1], [b"b", 3, 2], [b"c", 4, 3]]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # uvicorn serves the router on uvloop
def test_concurrent_callers_share_one_connection_and_each_gets_its_reply(session_redis, loop) -> None:
    client = redis.Redis.from_url(session_redis.url)

    async def run() -> tuple[list[object], int]:
        pipe = RedisPipe(lean_url(session_redis.url), 5.0)  # type: ignore[arg-type]
        try:
            before = int(client.info("clients")["connected_clients"])
            replies = await asyncio.gather(*(pipe.execute("ECHO", f"m{i}") for i in range(300)))
            return list(replies), int(client.info("clients")["connected_clients"]) - before
        finally:
            await pipe.aclose()

    if loop == "uvloop":
        import uvloop

        event_loop = uvloop.new_event_loop()
        try:
            replies, opened = event_loop.run_until_complete(run())
        finally:
            event_loop.close()
    else:
        replies, opened = asyncio.run(run())
    assert replies == [f"m{i}".encode() for i in range(300)] and opened == 1


def test_an_error_reply_fails_its_call_only(session_redis) -> None:
    async def run() -> list[object]:
        pipe = RedisPipe(lean_url(session_redis.url), 2.0)  # type: ignore[arg-type]
        try:
            return await asyncio.gather(pipe.execute("NOSUCHCOMMAND"), pipe.execute("PING"),
                                        return_exceptions=True)
        finally:
            await pipe.aclose()

    bad, good = asyncio.run(run())
    assert isinstance(bad, ReplyError) and good == b"PONG"


def test_the_password_and_database_of_the_url_are_used(tmp_path) -> None:
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed"
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "s3cret"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 10, what="redis-server")

        async def run(url: str) -> object:
            pipe = RedisPipe(lean_url(url), 2.0)  # type: ignore[arg-type]
            try:
                return await pipe.execute("SET", "k", "in-db-3")
            finally:
                await pipe.aclose()

        assert asyncio.run(run(f"redis://:s3cret@127.0.0.1:{port}/3")) == b"OK"
        assert redis.Redis(port=port, password="s3cret", db=3).get("k") == b"in-db-3"
        assert redis.Redis(port=port, password="s3cret", db=0).get("k") is None
        with pytest.raises(ReplyError):
            asyncio.run(run(f"redis://:wrong@127.0.0.1:{port}/3"))
    finally:
        server.kill()
        server.wait(10)


def test_a_redis_that_does_not_answer_fails_the_call_in_time_and_is_left() -> None:
    """A server that reads commands and never answers: the call fails within its timeout and
    the connection is closed, so nothing waits on it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    closed = threading.Event()

    def silent() -> None:
        conn, _ = listener.accept()
        while conn.recv(4096):
            pass
        closed.set()  # the client closed it
        conn.close()

    threading.Thread(target=silent, daemon=True).start()

    async def run() -> float:
        pipe = RedisPipe(Endpoint("127.0.0.1", port), 0.3)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await pipe.execute("PING")
        took = time.monotonic() - started
        await pipe.aclose()
        return took

    try:
        took = asyncio.run(run())
        assert 0.25 <= took < 2.0
        assert closed.wait(5)
    finally:
        listener.close()


def test_a_lost_connection_fails_its_calls_and_the_next_call_opens_another(redis_server) -> None:
    async def run() -> None:
        pipe = RedisPipe(lean_url(redis_server.url), 2.0)  # type: ignore[arg-type]
        try:
            assert await pipe.execute("PING") == b"PONG"
            redis_server.kill()
            with pytest.raises(ConnectionError):
                await pipe.execute("PING")
            redis_server.start()
            assert await pipe.execute("PING") == b"PONG"
        finally:
            await pipe.aclose()

    asyncio.run(run())


def test_redis_py_takes_the_same_calls(session_redis) -> None:
    key = f"pipe-{uuid.uuid4().hex}"

    async def run() -> list[object]:
        calls = RedisPyClient(session_redis.url, 2.0)
        try:
            return [await calls.run_script(SCRIPT, [], ["x", 1, key]), await calls.execute("GET", key)]
        finally:
            await calls.aclose()

    assert asyncio.run(run()) == [[b"x", 2, 1], b"1"]


def test_an_admission_is_one_command_to_redis(session_redis) -> None:
    """The one round trip a limited tenant's request waits for (docs/router.md, "Tenants")."""
    from kvscale.router.tenant_limiter import TenantLimiter

    client = redis.Redis.from_url(session_redis.url)
    tenant = Tenant(f"t-{uuid.uuid4().hex[:8]}", b"", 10**6, 10**9)

    async def run() -> tuple[dict[str, int], dict[str, int]]:
        limiter = TenantLimiter(session_redis.url, 2.0)
        try:
            await limiter.admit(tenant, 5)  # the script reaches Redis's cache
            before = _commands(client)
            for _ in range(10):
                assert (await limiter.admit(tenant, 5)) is not None
            return before, _commands(client)
        finally:
            await limiter.close()

    before, after = asyncio.run(run())
    sent = {name: calls - before.get(name, 0) for name, calls in after.items()
            if calls != before.get(name, 0) and name != "info"}
    # Command stats count the script's own calls too; no other command reached Redis.
    assert sent.pop("evalsha") == 10 and set(sent) <= {"time", "get", "incr", "incrby", "pexpire"}
