"""Hostile clients for `bench/soak.py --hostile`: what a careless or malicious tenant
sends a router, each kind in its own loop until told to stop.

- ``oversized``: a body declared at 64 MiB, sent in 1 MiB pieces (refused 413 before it is read);
- ``slow_loris``: a 4 KiB body sent a byte a second (refused 408 after --request-body-timeout);
- ``many_prompts``: one completion request holding 5,000 prompts (refused 400 by the replica);
- ``disconnect``: a long stream left after its first chunk (the replica must free its blocks).

Each answer's status is counted per kind; 0 means the connection closed without one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

MODEL = "smollm2-135m-instruct"
CONCURRENCY = {"oversized": 2, "slow_loris": 8, "many_prompts": 1, "disconnect": 4}


@dataclass
class HostileStats:
    statuses: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in CONCURRENCY})
    held_s: list[float] = field(default_factory=list)  # how long each slow-loris upload was kept

    def as_dict(self) -> dict:
        return {"statuses": {kind: dict(counts) for kind, counts in self.statuses.items()},
                "sent": {kind: sum(counts.values()) for kind, counts in self.statuses.items()},
                "slow_loris_held_s_max": round(max(self.held_s), 1) if self.held_s else None}


async def _status_of(reader: asyncio.StreamReader) -> int:
    try:
        line = await asyncio.wait_for(reader.readline(), 5)
        return int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/") else 0
    except (TimeoutError, ConnectionError, ValueError, IndexError):
        return 0


async def _raw_upload(url: str, declared: int, piece: bytes, pause_s: float, limit_s: float) -> tuple[int, float]:
    """POST /v1/completions declaring ``declared`` bytes, sending ``piece`` every ``pause_s`` until
    the server answers or closes; its status and how long the connection was held."""
    parts = urlsplit(url)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode())
        sent = 0
        while sent < declared and time.monotonic() - started < limit_s:
            answer = asyncio.ensure_future(reader.readline())
            done, _ = await asyncio.wait({answer}, timeout=pause_s)
            if done:
                line = answer.result()
                status = int(line.split(b" ", 2)[1]) if line.startswith(b"HTTP/") else 0
                return status, time.monotonic() - started
            answer.cancel()
            try:
                writer.write(piece[: declared - sent])
                await writer.drain()
            except ConnectionError:
                break
            sent += len(piece)
        return await _status_of(reader), time.monotonic() - started
    finally:
        writer.close()


async def oversized(url: str, stats: HostileStats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        status, _ = await _raw_upload(url, 64 * 2**20, b"x" * 2**20, 0.01, 30)
        stats.statuses["oversized"][status] += 1


async def slow_loris(url: str, stats: HostileStats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        status, held = await _raw_upload(url, 4096, b"x", 1.0, 300)
        stats.statuses["slow_loris"][status] += 1
        stats.held_s.append(held)


async def many_prompts(url: str, stats: HostileStats, stop: asyncio.Event) -> None:
    body = json.dumps({"model": MODEL, "prompt": [f"prompt {i}" for i in range(5000)], "max_tokens": 1})
    async with httpx.AsyncClient(timeout=120) as client:
        while not stop.is_set():
            try:
                response = await client.post(f"{url}/v1/completions", content=body,
                                             headers={"Content-Type": "application/json"})
                stats.statuses["many_prompts"][response.status_code] += 1
            except httpx.HTTPError:
                stats.statuses["many_prompts"][0] += 1
            await asyncio.sleep(0.5)


async def disconnect(url: str, stats: HostileStats, stop: asyncio.Event) -> None:
    body = {"model": MODEL, "prompt": "Tell a very long story:", "max_tokens": 256, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        while not stop.is_set():
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    stats.statuses["disconnect"][response.status_code] += 1
                    async for _ in response.aiter_raw():
                        break  # gone after the first chunk
            except httpx.HTTPError:
                stats.statuses["disconnect"][0] += 1


async def run_hostile(routers: list[str], stats: HostileStats, stop: asyncio.Event) -> None:
    kinds = {"oversized": oversized, "slow_loris": slow_loris, "many_prompts": many_prompts,
             "disconnect": disconnect}
    await asyncio.gather(*(kinds[kind](routers[i % len(routers)], stats, stop)
                           for kind, count in CONCURRENCY.items() for i in range(count)))
