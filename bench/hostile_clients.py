"""Hostile clients for `bench/soak.py --hostile`: what a careless or malicious tenant
sends a router, each kind in its own loop until told to stop. All but one hold the routers' API
key (a tenant misbehaving, not a stranger).

- ``oversized``: a body declared at 64 MiB, sent in 1 MiB pieces at 100 MiB/s, one upload after
  another with ``PAUSE_S`` between (refused 413 before it is read);
- ``slow_loris``: a 4 KiB body sent a byte a second (refused 408 after --request-body-timeout);
- ``many_prompts``: one completion request holding 5,000 prompts (refused 400 by the replica);
- ``disconnect``: a long stream left after its first chunk (the replica must free its blocks),
  each client starting one every ``DISCONNECT_EVERY_S``;
- ``bomb``: up to --max-sequences-per-request prompts sharing a full logit_bias and a full list of
  stop strings: each must end within the client's deadline, answered with every choice or
  refused 400/503/504 (hostile_payloads.bomb_outcome); the replica stays up;
- ``over_*``: one request over one field limit each (bench/hostile_payloads.py), in turn: a 400
  whose message names the limit's flag;
- ``unauthenticated``: no key, a body announced at 30 MiB (refused 401 from the head: no byte of
  the body is sent before the answer);
- ``slow_schema``: distinct slow-to-compile JSON schemas (each fails alone, 400 or 503).

Each answer's status is counted per kind; 0 means the connection closed without one. The soak runs
them in a process of their own (bench/hostile_process.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from bench.hostile_payloads import (
    MODEL,
    bomb_body,
    bomb_outcome,
    names_limit,
    over_limit_requests,
    slow_schema_body,
)

OVER_LIMIT_KINDS = tuple(over_limit_requests())
# Clients per kind. The newer kinds stay at one or two: the host has 2 cores, and each of their
# requests costs a replica far more than an honest one.
CONCURRENCY = {"oversized": 2, "slow_loris": 8, "many_prompts": 1, "disconnect": 4, "bomb": 1,
               "over_limit": 1, "unauthenticated": 2, "slow_schema": 1}
# Kinds as counted: the over-limit loop counts each limit on its own.
KINDS = (*(k for k in CONCURRENCY if k != "over_limit"), *OVER_LIMIT_KINDS)
UNAUTHENTICATED_BYTES = 30 * 2**20
# Between two requests of a kind refused at once: without it each client would send hundreds a
# second, a flood of connections (which no limit under test bounds) taking the 2 cores the
# honest load and the soak's own clients share.
PAUSE_S = 0.25
# An oversized upload: 64 MiB declared, sent 1 MiB every 10 ms (a 100 MiB/s link) until answered.
OVERSIZED_BYTES = 64 * 2**20
OVERSIZED_PIECE_BYTES = 2**20
OVERSIZED_PIECE_EVERY_S = 0.01
# Each disconnecting client starts at most one stream this often.
DISCONNECT_EVERY_S = 1.0


def pacing() -> dict:
    """How hard the clients push, for the report: clients per kind, the pause after each refused
    request, and the oversized uploads' link rate."""
    return {"clients": dict(CONCURRENCY), "pause_after_refusal_s": PAUSE_S,
            "paused_kinds": ["oversized", "unauthenticated", "over_limit"],
            "oversized_link_mib_per_s": round(OVERSIZED_PIECE_BYTES / OVERSIZED_PIECE_EVERY_S / 2**20),
            "oversized_uploads_per_s_max": round(CONCURRENCY["oversized"] / PAUSE_S, 1),
            "abandoned_streams_per_s_max": round(CONCURRENCY["disconnect"] / DISCONNECT_EVERY_S, 1)}


@dataclass
class HostileStats:
    statuses: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    held_s: list[float] = field(default_factory=list)  # how long each slow-loris upload was kept
    named_limit: Counter = field(default_factory=Counter)  # over-limit 400s whose message names the flag
    unauthenticated_bytes_sent: list[int] = field(default_factory=list)  # before each answer
    bomb_s: list[float] = field(default_factory=list)
    bombs: list[dict] = field(default_factory=list)  # hostile_payloads.bomb_outcome, one per bomb
    bombs_given_up_at_end: list[float] = field(default_factory=list)  # seconds each had run
    bomb_in_flight_since: float | None = None  # time.monotonic() of the bomb now open
    # Each bomb's (sent, ended) in time.monotonic(), and the replica that served it (None: not known).
    bomb_spans: list[tuple[float, float, str | None]] = field(default_factory=list)
    slow_schema_spans: list[tuple[float, float, str | None]] = field(default_factory=list)  # as bomb_spans
    cancelled_at_end: bool = False  # requests still open after the grace were given up
    loop_errors: list[str] = field(default_factory=list)  # a client that crashed stopped counting

    def as_dict(self) -> dict:
        over = {kind: {"refused_400": self.statuses[kind][400], "named_the_limit": self.named_limit[kind]}
                for kind in OVER_LIMIT_KINDS}
        return {"statuses": {kind: dict(counts) for kind, counts in self.statuses.items()},
                "sent": {kind: sum(counts.values()) for kind, counts in self.statuses.items()},
                "slow_loris_held_s_max": round(max(self.held_s), 1) if self.held_s else None,
                "over_limit": over,
                "unauthenticated_body_bytes_sent_max": max(self.unauthenticated_bytes_sent, default=None),
                "bomb_s_max": round(max(self.bomb_s), 1) if self.bomb_s else None,
                "bombs": self.bombs,
                "bombs_given_up_at_end_s": [round(s, 1) for s in self.bombs_given_up_at_end],
                "cancelled_at_end": self.cancelled_at_end, "loop_errors": self.loop_errors}


def _status_line(line: bytes) -> int:
    return int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/") else 0


async def _status_of(reader: asyncio.StreamReader) -> int:
    try:
        return _status_line(await asyncio.wait_for(reader.readline(), 5))
    except (TimeoutError, ConnectionError, ValueError, IndexError):
        return 0


async def _raw_upload(url: str, declared: int, piece: bytes, pause_s: float, limit_s: float,
                      api_key: str | None) -> tuple[int, float, int]:
    """POST /v1/completions declaring ``declared`` bytes, sending ``piece`` every ``pause_s`` (the
    first after ``pause_s`` too) until the server answers or closes; its status, how long the
    connection was held, and the body bytes sent before the answer."""
    parts = urlsplit(url)
    started = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    except OSError:
        return 0, time.monotonic() - started, 0
    sent = 0
    try:
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth}"
                      f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode())
        while sent < declared and time.monotonic() - started < limit_s:
            answer = asyncio.ensure_future(reader.readline())
            done, _ = await asyncio.wait({answer}, timeout=pause_s)
            if done:
                try:
                    return _status_line(answer.result()), time.monotonic() - started, sent
                except (ConnectionError, ValueError, IndexError):
                    return 0, time.monotonic() - started, sent
            answer.cancel()
            try:
                writer.write(piece[: declared - sent])
                await writer.drain()
            except ConnectionError:
                break
            sent += min(len(piece), declared - sent)
        return await _status_of(reader), time.monotonic() - started, sent
    finally:
        writer.close()


Loop = Callable[[str, HostileStats, asyncio.Event, str | None], Awaitable[None]]


async def oversized(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
    # Paced like the other kinds refused at once (PAUSE_S): unpaced, each client opened ~350
    # connections a second, a connection flood (which no limit under test bounds) whose cost fell
    # on the soak's own clients as much as on the routers.
    while not stop.is_set():
        status, _, _ = await _raw_upload(url, OVERSIZED_BYTES, b"x" * OVERSIZED_PIECE_BYTES,
                                         OVERSIZED_PIECE_EVERY_S, 30, api_key)
        stats.statuses["oversized"][status] += 1
        await asyncio.sleep(PAUSE_S)


async def slow_loris(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
    while not stop.is_set():
        status, held, _ = await _raw_upload(url, 4096, b"x", 1.0, 300, api_key)
        stats.statuses["slow_loris"][status] += 1
        stats.held_s.append(held)


async def unauthenticated(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
    # Two seconds before the first piece: a router that answers from the head has long answered.
    while not stop.is_set():
        status, _, sent = await _raw_upload(url, UNAUTHENTICATED_BYTES, b"x" * 2**20, 2.0, 60, None)
        stats.statuses["unauthenticated"][status] += 1
        stats.unauthenticated_bytes_sent.append(sent)
        await asyncio.sleep(PAUSE_S)


async def _post(client: httpx.AsyncClient, url: str, body: dict | str) -> tuple[int, bytes]:
    status, content, _ = await _post_to_replica(client, url, body)
    return status, content


async def _post_to_replica(client: httpx.AsyncClient, url: str, body: dict | str) -> tuple[int, bytes, str | None]:
    """The answer's status and body, and the replica the router says served it."""
    content = body if isinstance(body, str) else json.dumps(body)
    try:
        response = await client.post(url, content=content, headers={"Content-Type": "application/json"})
        return response.status_code, response.content, response.headers.get("x-kvscale-replica")
    except httpx.HTTPError:
        return 0, b"", None


def _client(api_key: str | None, timeout_s: float = 300) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})


async def many_prompts(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
    body = json.dumps({"model": MODEL, "prompt": [f"prompt {i}" for i in range(5000)], "max_tokens": 1})
    async with _client(api_key) as client:
        while not stop.is_set():
            status, _ = await _post(client, f"{url}/v1/completions", body)
            stats.statuses["many_prompts"][status] += 1
            await asyncio.sleep(0.5)


async def disconnect(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
    # At a fixed rate, not one after another: back to back, the rate followed the replicas' speed
    # (5 a second on one host, 23 on a faster one, 7x the honest requests), a load test of its own
    # rather than the check that a stream left frees its blocks.
    body = {"model": MODEL, "prompt": "Tell a very long story:", "max_tokens": 256, "stream": True,
            "ignore_eos": True}
    async with _client(api_key) as client:
        while not stop.is_set():
            next_at = time.monotonic() + DISCONNECT_EVERY_S
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    stats.statuses["disconnect"][response.status_code] += 1
                    async for _ in response.aiter_raw():
                        break  # gone after the first chunk
            except httpx.HTTPError:
                stats.statuses["disconnect"][0] += 1
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


def bomb(sequences: int, pause_s: float, deadline_s: float) -> Loop:
    """Bombs one after another, each given ``deadline_s`` in all (not per read, as httpx's
    timeout): no answer by then is its outcome, ``deadline_exceeded``. One still open when the
    soak ends is given up and listed apart, not judged."""
    async def loop(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
        body = json.dumps(bomb_body(sequences))
        async with _client(api_key, deadline_s + 5) as client:
            while not stop.is_set():
                started = stats.bomb_in_flight_since = time.monotonic()
                status: int | None
                replica: str | None = None
                try:
                    status, answer, replica = await asyncio.wait_for(
                        _post_to_replica(client, f"{url}/v1/completions", body), deadline_s)
                except TimeoutError:
                    status, answer = None, b""
                except asyncio.CancelledError:
                    stats.bombs_given_up_at_end.append(time.monotonic() - started)
                    raise
                finally:
                    stats.bomb_in_flight_since = None
                    stats.bomb_spans.append((started, time.monotonic(), replica))
                seconds = time.monotonic() - started
                stats.statuses["bomb"][status or 0] += 1
                stats.bomb_s.append(seconds)
                stats.bombs.append(bomb_outcome(status, answer, seconds, sequences, deadline_s))
                await asyncio.sleep(pause_s)  # the bomb recurs; it does not occupy a replica for good
    return loop


async def over_limit(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
    requests = {kind: (path, json.dumps(body), expected)
                for kind, (path, body, expected) in over_limit_requests().items()}
    async with _client(api_key) as client:
        while not stop.is_set():
            for kind, (path, body, expected) in requests.items():
                status, answer = await _post(client, f"{url}{path}", body)
                stats.statuses[kind][status] += 1
                stats.named_limit[kind] += status == 400 and names_limit(answer, expected)
                await asyncio.sleep(PAUSE_S)


def slow_schema(first_index: int) -> Loop:
    async def loop(url: str, stats: HostileStats, stop: asyncio.Event, api_key: str | None) -> None:
        index = first_index
        async with _client(api_key) as client:
            while not stop.is_set():
                sent = time.monotonic()
                status, _, replica = await _post_to_replica(client, f"{url}/v1/chat/completions",
                                                            slow_schema_body(index))
                stats.slow_schema_spans.append((sent, time.monotonic(), replica))
                stats.statuses["slow_schema"][status] += 1
                index += 1
    return loop


async def run_hostile(routers: list[str], stats: HostileStats, stop: asyncio.Event, api_key: str | None,
                      bomb_sequences: int, bomb_pause_s: float = 5.0,
                      bomb_deadline_s: float = 300.0) -> None:
    """Every kind's clients against the routers in turn, until ``stop``."""
    loops: dict[str, Loop] = {
        "oversized": oversized, "slow_loris": slow_loris, "many_prompts": many_prompts,
        "disconnect": disconnect, "bomb": bomb(bomb_sequences, bomb_pause_s, bomb_deadline_s), "over_limit": over_limit,
        "unauthenticated": unauthenticated, "slow_schema": slow_schema(0)}

    async def guarded(kind: str, loop: Loop, url: str) -> None:
        try:
            await loop(url, stats, stop, api_key)
        except Exception as exc:  # noqa: BLE001 - reported, and the other clients go on
            stats.loop_errors.append(f"{kind}: {type(exc).__name__}: {exc}")

    clients = []
    for kind, count in CONCURRENCY.items():
        for i in range(count):
            loop = slow_schema(i * 10_000) if kind == "slow_schema" else loops[kind]
            clients.append(guarded(kind, loop, routers[i % len(routers)]))
    await asyncio.gather(*clients)
