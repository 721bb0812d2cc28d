"""The chaos soak's clients: streamed completions of mixed lengths through the two routers, a
third of them hung up mid-stream on purpose, each retried on the other router as a Service in
front of them would (bench/soak.py's docstring)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from bench.soak_platform import Platform

PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely. ",
    "The following is a conversation about the history of the Mediterranean sea and its ports. ",
    "Summarise the text below for a busy reader who has only a minute to spare. ",
]
WORDS = "river mountain lantern harbour orchard copper meadow signal winter ledger compass".split()


@dataclass
class Outcome:
    index: int
    started: float
    ended: float = 0.0
    replica: str | None = None
    router_ms: float | None = None
    chunks: int = 0
    done: bool = False  # saw [DONE]
    hung_up: bool = False  # the client left on purpose
    error: str | None = None
    router_retries: int = 0
    first_chunk_s: float | None = None  # time to the first streamed chunk (TTFT as a client sees it)


# Transport failures that leave a request unanswered and may be retried on another router.
RETRIED_BEFORE_HEAD = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def _prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.choice([4, 12, 40, 120])))
    return rng.choice(PREFIXES) + words


async def one_request(client: httpx.AsyncClient, routers: list[str], index: int, rng: random.Random,
                      outcomes: list[Outcome]) -> None:
    outcome = Outcome(index, time.monotonic())
    outcomes.append(outcome)
    body = {"prompt": _prompt(rng), "max_tokens": rng.choice([4, 8, 16, 32, 64]), "temperature": 0.8,
            "stream": True, "ignore_eos": True}
    hang_up_after = rng.randint(1, 6) if rng.random() < 1 / 3 else None
    order = routers[index % len(routers):] + routers[: index % len(routers)]
    tries = order * 3  # a Service in front of the routers, retried briefly
    for attempt, router in enumerate(tries):
        head = False  # the router's response status and headers arrived
        try:
            async with client.stream("POST", f"{router}/v1/completions", json=body) as response:
                head = True
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:200]
                    if response.status_code == 503 and attempt + 1 < len(tries):
                        outcome.router_retries += 1
                        await asyncio.sleep(0.2)
                        continue
                    outcome.error = f"HTTP {response.status_code}: {text}"
                    break
                outcome.replica = response.headers.get("x-kvscale-replica")
                ms = response.headers.get("x-kvscale-router-ms")
                outcome.router_ms = float(ms) if ms else None
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        outcome.done = True
                        break
                    outcome.chunks += 1
                    if outcome.first_chunk_s is None:
                        outcome.first_chunk_s = time.monotonic() - outcome.started
                    if '"error"' in line[:20]:
                        outcome.error = line[:200]
                    if hang_up_after is not None and outcome.chunks >= hang_up_after:
                        outcome.hung_up = True
                        break
                break
        except RETRIED_BEFORE_HEAD as exc:
            # A stopping router closes its idle keep-alive connections; one the client picked from
            # its pool at that moment is reset before any answer. Clients retry that (the openai
            # client retries every connection error); a failure after the answer began is a loss.
            if not head and attempt + 1 < len(tries):
                outcome.router_retries += 1
                await asyncio.sleep(0.2)
                continue
            outcome.error = f"{type(exc).__name__}: {exc}"
            break
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            break
    outcome.ended = time.monotonic()


async def load(platform_: Platform, requests: int, concurrency: int, seed: int, outcomes: list[Outcome],
               schedule_done=lambda: True) -> None:
    """``requests`` requests, and more (up to 3x) while the fault schedule is still running."""
    routers = platform_.router_urls()
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=2.0), limits=limits,
                                 headers=platform_.client_headers()) as client:
        issued = 0

        async def worker(w: int) -> None:
            nonlocal issued
            local = random.Random(seed * 1000 + w)
            while issued < requests or (not schedule_done() and issued < 3 * requests):
                issued += 1
                await one_request(client, routers, issued - 1, local, outcomes)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
