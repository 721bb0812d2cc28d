"""The in-process store of /v1/responses: bounded by entries and bytes (least recently used
evicted first) and by a time to live, whatever a client stores."""

from __future__ import annotations

import asyncio

import pytest

from kvscale.server.entrypoints.responses_store import MemoryResponseStore, StoredResponse


def record(text: str) -> StoredResponse:
    return StoredResponse({"id": text, "output": []}, [{"role": "user", "content": text}])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(coroutine):
    return asyncio.run(coroutine)


def test_entries_are_bounded_least_recently_used_first() -> None:
    store = MemoryResponseStore(max_entries=3)
    for name in "abc":
        assert run(store.put(name, record(name)))
    assert run(store.get("a")) == record("a")  # a is now the most recently used
    run(store.put("d", record("d")))
    assert len(store) == 3
    assert run(store.get("b")) is None
    assert [run(store.get(name)) for name in "acd"] == [record(name) for name in "acd"]


def test_bytes_are_bounded() -> None:
    size = len(record("aaaa").to_bytes())
    store = MemoryResponseStore(max_bytes=2 * size + size // 2)
    for name in ("aaaa", "bbbb", "cccc"):
        run(store.put(name, record(name)))
    assert store.total_bytes <= store.max_bytes and len(store) == 2
    assert run(store.get("aaaa")) is None and run(store.get("cccc")) == record("cccc")
    assert not run(store.put("big", record("x" * 3 * size)))  # larger than the whole store
    assert run(store.get("big")) is None and len(store) == 2


def test_entries_expire() -> None:
    clock = Clock()
    store = MemoryResponseStore(ttl_s=10, clock=clock)
    run(store.put("a", record("a")))
    clock.now = 5
    run(store.put("b", record("b")))
    clock.now = 10
    assert run(store.get("a")) is None and run(store.get("b")) == record("b")
    clock.now = 15
    run(store.put("c", record("c")))  # a put sweeps what expired
    assert len(store) == 1 and store.total_bytes == len(record("c").to_bytes())


def test_delete_and_replace() -> None:
    store = MemoryResponseStore()
    run(store.put("a", record("a")))
    run(store.put("a", record("again")))
    assert len(store) == 1 and store.total_bytes == len(record("again").to_bytes())
    assert run(store.delete("a")) and not run(store.delete("a"))
    assert store.total_bytes == 0 and run(store.get("a")) is None


def test_a_store_needs_room() -> None:
    with pytest.raises(ValueError):
        MemoryResponseStore(max_entries=0)


@pytest.mark.parametrize("flag", ["--responses-store-max-entries=0", "--responses-store-max-bytes=0",
                                  "--responses-store-ttl=0", "--responses-store=redis"])
def test_a_store_without_room_is_refused_before_anything_starts(flag: str, capsys, monkeypatch) -> None:
    from kvscale.cli import build_parser
    from kvscale.server.entrypoints.cli_serve import run

    monkeypatch.delenv("KVSCALE_REDIS_URL", raising=False)  # redis without a Redis
    assert run(build_parser("serve").parse_args(["serve", flag])) == 2
    assert flag.split("=")[0] in capsys.readouterr().err
