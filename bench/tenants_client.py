"""The tenant benchmark's clients (bench.tenants): one request as a tenant, timed and recorded
with what the router answered (status, first token, usage, its added latency, a 429's
Retry-After and code); closed loops that keep a tenant's requests in flight; requests one after
the other. Each request goes to the routers in turn, as a client behind a load balancer would.
And the processes whose CPU the priority figure counts: this client and the fleet it started."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.stats import quantile
from bench.w3_fleet import MODEL


@dataclass
class Answer:
    tenant: str
    router: int  # index into the routers the request went to
    sent_s: float  # perf_counter
    first_token_s: float | None  # streamed requests only
    ended_s: float
    status: int
    prompt_tokens: int
    completion_tokens: int
    router_ms: float | None  # x-kvscale-router-ms: the router's time from the body to the decision
    retry_after: str | None
    error_code: str | None
    # A stream asked with ``logprobs``: (perf_counter, tokens) of each chunk, its tokens counted
    # from its logprobs (a chunk may carry several under load).
    chunks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "ttft_s": self.ttft_s}


def completion(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A completion of exactly ``max_tokens`` tokens (``ignore_eos``); a stream reports its usage."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(client: httpx.AsyncClient, routers: list[str], router: int, key: str | None, tenant: str,
               body: dict[str, Any]) -> Answer:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"{routers[router]}/v1/completions"
    sent = time.perf_counter()
    first: float | None = None
    usage: dict[str, int] = {}
    chunks: list[tuple[float, int]] = []
    error_code = None
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200 or not body.get("stream"):
            raw = await response.aread()
            try:
                payload = json.loads(raw) if raw else {}
            except ValueError:  # not OpenAI's error JSON (recorded by its status alone)
                payload = {}
            usage = payload.get("usage") or {}
            error_code = (payload.get("error") or {}).get("code")
        else:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if first is None and chunk.get("choices"):
                    first = now
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if tokens := len((choice.get("logprobs") or {}).get("tokens") or []):
                        chunks.append((now, tokens))
    router_ms = response.headers.get("x-kvscale-router-ms")
    return Answer(tenant, router, sent, first, time.perf_counter(), response.status_code,
                  usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                  float(router_ms) if router_ms else None, response.headers.get("retry-after"), error_code,
                  chunks)


def http_client(in_flight: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=in_flight + 8, max_keepalive_connections=in_flight + 8)
    return httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits)


async def closed_loop(client: httpx.AsyncClient, routers: list[str], key: str, tenant: str,
                      make_body: Callable[[int], dict[str, Any]], in_flight: int,
                      stop: asyncio.Event) -> list[Answer]:
    """``in_flight`` requests of ``tenant`` at all times until ``stop`` is set; those sent by
    then are waited for, so the fleet is idle when this returns."""
    answers: list[Answer] = []
    counter = iter(range(1 << 62))

    async def worker() -> None:
        while not stop.is_set():
            n = next(counter)
            answers.append(await send(client, routers, n % len(routers), key, tenant, make_body(n)))

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return answers


async def one_by_one(client: httpx.AsyncClient, routers: list[str], key: str | None, tenant: str,
                     make_body: Callable[[int], dict[str, Any]], count: int,
                     pause_s: float = 0.0) -> list[Answer]:
    """``count`` requests of ``tenant``, each sent when the one before has ended."""
    answers = []
    for n in range(count):
        answers.append(await send(client, routers, n % len(routers), key, tenant, make_body(n)))
        await asyncio.sleep(pause_s)
    return answers


async def beside_load(client: httpx.AsyncClient, load: Callable[[asyncio.Event], Any],
                      measured: Callable[[], Any], warm_s: float) -> tuple[list[Answer], list[Answer]]:
    """The ``measured`` requests sent ``warm_s`` after the ``load`` started (its backlog built),
    the load stopped once they are done: (measured answers, load answers)."""
    stop = asyncio.Event()
    background = asyncio.ensure_future(load(stop))
    await asyncio.sleep(warm_s)
    try:
        answers = await measured()
    finally:
        stop.set()
    return answers, await background


def probe_twins(prompt_of: Callable[[int], str], max_tokens: int) -> Callable[[int], dict[str, Any]]:
    """The n-th priority probe, streamed: prompt n // 2 for even n; for odd n another one (no
    prefix shared with an even one's), with skip_special_tokens false, so its first chunk carries
    its first token even when that token has no text: bench.tenants' priority figure is the odd
    ones' TTFT, the even ones' (the first chunk with text) is reported beside it."""
    def body(n: int) -> dict[str, Any]:
        if n % 2 == 0:
            return completion(prompt_of(n // 2), max_tokens, True)
        return {**completion(prompt_of(1000 + n // 2), max_tokens, True), "skip_special_tokens": False}
    return body


CLIENT_ONLY = frozenset({"bench_client"})  # its children are the fleet, each counted on its own


def fleet_pids() -> dict[str, int]:
    """This process (the clients) and each process it started (the fleet: Redis, the replicas with
    their engine cores, the routers), named by what it runs."""
    pids = {"bench_client": os.getpid()}
    for child in psutil.Process().children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        kind = next((word for word in ("serve", "router") if word in argv),
                    Path(argv[0]).name if argv else "process")
        pids[f"{kind}-{child.pid}"] = child.pid
    return pids


def token_service(answer: Answer) -> list[tuple[float, str, int]]:
    """When ``answer``'s tokens were served, as VTC counts service: its prompt with its first
    token, then each chunk's generated tokens."""
    if answer.first_token_s is None:
        return [(answer.ended_s, answer.tenant, answer.tokens)]
    return [(answer.first_token_s, answer.tenant, answer.prompt_tokens),
            *((at, answer.tenant, tokens) for at, tokens in answer.chunks)]


def ttft_summary(answers: list[Answer]) -> dict[str, Any]:
    ttfts = [a.ttft_s for a in answers if a.status == 200 and a.ttft_s is not None]
    return {"requests": len(answers), "errors": len(answers) - len(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p90_s": quantile(ttfts, 0.9)}


def completed_per_s(answers: list[Answer]) -> float | None:
    done = [a for a in answers if a.status == 200]
    if len(done) < 2:
        return None
    return len(done) / (max(a.ended_s for a in done) - min(a.sent_s for a in done))
