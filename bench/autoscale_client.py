"""Level (a)'s client (bench.autoscale_platform): each simulated request sent as a streamed
completion of the bundled model at its arrival time, TTFT, TPOT and failures measured at the
client; and the probes sent to one replica before each trace (its decode steps alone, spaced
requests beside decoding streams) that level (b) takes the platform's costs from."""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench.autoscale_workloads import prefix_group, shaped_request
from bench.w3_sim import SimRequest

MODEL = "smollm2-135m-instruct"


# One token each for the bundled model's tokenizer, so a prompt is ~its SimRequest's length.
WORDS = ("pod node service volume secret replica deployment label selector quota limit request "
         "probe lease event namespace cluster").split()


@dataclass
class Outcome:
    arrival: float
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None
    chunk_times: list[float] | None = None  # a list: every chunk's arrival is added to it


def prompt_text(request: SimRequest) -> str:
    """About ``prompt_tokens`` tokens: its shared 128-token prefix group, then its own words."""
    group = prefix_group(request)
    rng = random.Random(group)
    shared = " ".join(rng.choice(WORDS) for _ in range(120))
    own_rng = random.Random(10_000 + request.rid)
    own = " ".join(own_rng.choice(WORDS) for _ in range(max(1, request.prompt_tokens - 128)))
    return f"Notes {group}: {shared}\nTicket {request.rid}: {own}\nSummary:"


PROBE_TOKENS = 200


PROBE_REQUESTS = 12  # sent one at a time, PROBE_SPACING_S apart: the trace's shape


PROBE_SPACING_S = 0.75


PROBE_START_S = 1.0  # after the background streams started


# Streams decoding all through the TTFT probe, so that it sees a busy replica, as the trace's
# requests do (a batch of about this size in its x4 step).
PROBE_BACKGROUND_STREAMS = 3


PROBE_BACKGROUND_TOKENS = 400


def probe_decode_gaps(url: str) -> list[float]:
    """One replica's decode steps on this host beside the rest of the platform, as a client sees
    them: one streamed answer of PROBE_TOKENS tokens through the router, alone, its gaps between
    tokens (one step each at a batch of one). Its prompt shares no block with the trace's."""
    import httpx

    outcome = Outcome(0.0, chunk_times=[])
    with httpx.Client(timeout=120) as client:  # group 49: the trace's groups are 0-7
        send(client, url, shaped_request(100_200, 49, 0.0, output=PROBE_TOKENS), time.monotonic(), outcome)
    arrivals = outcome.chunk_times or []
    gaps = [round(b - a, 5) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    if outcome.error is not None or len(gaps) < PROBE_TOKENS // 2:
        raise RuntimeError(f"the probe streamed {len(arrivals)} chunks for {PROBE_TOKENS} tokens: "
                           f"{outcome.error}")
    return gaps


def probe_requests() -> tuple[list[SimRequest], list[SimRequest]]:
    """The TTFT probe: (its background streams, its requests). The requests have the trace's
    shape (a 128-token prefix shared among them, 256-token prompts, 32-token answers) in a prefix
    group of their own and come one at a time while the streams decode."""
    # Groups 50 and up: the trace's are 0-7.
    background = [shaped_request(100_100 + i, 51 + i, 0.0, output=PROBE_BACKGROUND_TOKENS)
                  for i in range(PROBE_BACKGROUND_STREAMS)]
    probes = [shaped_request(100_000 + i, 50, PROBE_START_S + i * PROBE_SPACING_S)
              for i in range(PROBE_REQUESTS)]
    return background, probes


def probe_ttfts(url: str) -> tuple[list[tuple[float, float | None]], dict[str, float]]:
    """(sent at, TTFT) of `probe_requests` through the router, one at a time beside its
    background streams: what the path from client to engine and back adds to a first token on a
    busy replica, which the simulator's engine does not model; and the decode step at that batch
    as the client saw it (the background streams' TPOT, median; the batch: the streams plus the
    probe requests open on average)."""
    import httpx

    background, requests = probe_requests()
    outcomes = [Outcome(r.arrival) for r in requests]
    streamed = [Outcome(r.arrival) for r in background]
    start = time.monotonic()
    with httpx.Client(timeout=120) as client:
        streams = [threading.Thread(target=send, args=(client, url, r, start, o), daemon=True)
                   for r, o in zip(background, streamed, strict=True)]
        for stream in streams:
            stream.start()
        for request, outcome in zip(requests, outcomes, strict=True):
            send(client, url, request, start, outcome)
        for stream in streams:
            stream.join(120)
    tpots = [o.tpot for o in streamed if o.tpot is not None]
    served = [o for o in outcomes if o.ttft is not None and o.tpot is not None]
    if len(tpots) < len(background) or not served:
        raise RuntimeError(f"the TTFT probe failed: {[o.error for o in streamed + outcomes if o.error]}")
    open_s = sum(o.ttft + (requests[0].output_tokens - 1) * o.tpot for o in served)  # type: ignore[operator]
    batch = len(background) + open_s / (len(requests) * PROBE_SPACING_S)
    return ([(o.arrival, rounded(o.ttft)) for o in outcomes],
            {"batch": round(batch, 2), "tpot_s": round(statistics.median(tpots), 5)})


def send_all(url: str, requests: list[SimRequest], outcomes: list[Outcome]) -> None:
    """Each of ``requests`` at its arrival (seconds from now), concurrently, into ``outcomes``."""
    import httpx

    start = time.monotonic()
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=len(requests))) as client:
        threads = [threading.Thread(target=send, args=(client, url, r, start, o), daemon=True)
                   for r, o in zip(requests, outcomes, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)


def send(client: Any, url: str, request: SimRequest, start: float, outcome: Outcome) -> None:
    delay = start + request.arrival - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    t0 = time.monotonic()
    first = last = None
    chunks = 0
    try:
        with client.stream("POST", url + "/v1/completions", json={
                "model": MODEL, "prompt": prompt_text(request), "max_tokens": request.output_tokens,
                "min_tokens": request.output_tokens, "temperature": 0, "stream": True}) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
                    if outcome.chunk_times is not None:
                        outcome.chunk_times.append(last)
    except Exception as exc:  # every failure counted
        outcome.error = f"{type(exc).__name__}: {exc}"
        return
    if first is None or last is None:
        outcome.error = "no token"
        return
    outcome.ttft = first - t0
    outcome.tpot = (last - first) / (chunks - 1) if chunks > 1 else 0.0


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
