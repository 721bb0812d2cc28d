"""The fleet's store of /v1/responses in a real Redis: what one replica stores another reads and
deletes, and the bounds (entries, bytes, least recently used first, time to live) hold for the
whole fleet; an unreachable Redis is StoreUnavailable (a 503), never "not found"."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from kvscale.processes import free_port, wait_for_port
from kvscale.server.entrypoints.responses_store import StoredResponse, StoreUnavailable
from kvscale.server.entrypoints.responses_store_redis import RedisResponseStore


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (make system-deps installs Debian's redis-server)"
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 10, what="redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)


def record(text: str) -> StoredResponse:
    return StoredResponse({"id": text, "output": []}, [{"role": "user", "content": text}])


def run(coroutine):
    return asyncio.run(coroutine)


async def with_stores(url: str, model: str, body, **bounds):
    """``body(a, b)`` on two replicas' stores of one model."""
    a, b = RedisResponseStore(url, model, **bounds), RedisResponseStore(url, model, **bounds)
    try:
        return await body(a, b)
    finally:
        await a.close()
        await b.close()


def test_one_replica_stores_another_reads_and_deletes(redis_url: str) -> None:
    async def body(a, b):
        assert await a.put("r1", record("one"))
        assert await b.get("r1") == record("one")
        assert await b.delete("r1") and not await a.delete("r1")
        assert await a.get("r1") is None

    run(with_stores(redis_url, "shared", body))


def test_the_fleets_bounds_least_recently_used_first(redis_url: str) -> None:
    size = len(record("aaaa").to_bytes())

    async def entries(a, b):
        for name in ("a", "b", "c"):
            await (a if name != "b" else b).put(name, record(name))
        assert await b.get("a") == record("a")  # a is now the most recently used
        await a.put("d", record("d"))
        assert await a.get("b") is None
        assert [await b.get(name) for name in "acd"] == [record(name) for name in "acd"]

    async def bytes_(a, b):
        for name in ("aaaa", "bbbb", "cccc"):
            await a.put(name, record(name))
        assert await b.get("aaaa") is None and await b.get("cccc") == record("cccc")
        assert not await b.put("big", record("x" * 3 * size))
        total = int(await a.client.get(a.keys[3]))
        assert total == 2 * size

    run(with_stores(redis_url, "entries", entries, max_entries=3))
    run(with_stores(redis_url, "bytes", bytes_, max_bytes=2 * size + size // 2))


def test_records_expire_and_are_forgotten(redis_url: str) -> None:
    async def body(a, b):
        await a.put("old", record("old"))
        time.sleep(0.6)
        assert await b.get("old") is None
        await b.put("new", record("new"))  # a put forgets what expired
        assert await a.client.zcard(a.keys[0]) == 1
        assert int(await a.client.get(a.keys[3])) == len(record("new").to_bytes())

    run(with_stores(redis_url, "ttl", body, ttl_s=0.5))


def test_an_unreachable_redis_is_unavailable_not_not_found() -> None:
    async def body(a, b):
        with pytest.raises(StoreUnavailable):
            await a.get("r1")
        with pytest.raises(StoreUnavailable):
            await b.put("r1", record("one"))

    run(with_stores(f"redis://127.0.0.1:{free_port()}/0", "down", body))
