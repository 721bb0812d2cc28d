"""A burst of requests sharing a prefix nobody holds, in front of real replicas: each decision sees
the ones taken before it (the prompt predicted on the chosen replica, its prefill queued there),
though the forwards they start have not yet run, so the group stays on one replica."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from kvscale.processes import wait_until
from tests.router.conftest import MODEL

pytestmark = pytest.mark.slow

BURST = 6
PREFIX_WORDS = 300  # ~20 blocks of the bundled tokenizer: followers' saved prefill outweighs any queue


def burst_bodies(seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = ["river", "stone", "lamp", "orbit", "cedar", "violet", "harbor", "engine", "quartz", "meadow"]
    prefix = " ".join(rng.choice(words) for _ in range(PREFIX_WORDS))
    return [{"model": MODEL, "prompt": f"{prefix} question {i}: {rng.choice(words)}?", "max_tokens": 1,
             "temperature": 0} for i in range(BURST)]


async def send_together(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for body in bodies))


def test_a_burst_of_one_new_prefix_goes_to_one_replica(replicas, session_redis, launcher):
    router = launcher.router([r.url for r in replicas], session_redis.url, policy="predicted-ttft")
    # Named by their heartbeats (replica-0, replica-1) before the burst, not by URL at first.
    wait_until(lambda: {r["id"] for r in httpx.get(f"{router.url}/health", timeout=10).json()["replicas"]}
               == {"replica-0", "replica-1"}, 60, what="replicas named by their heartbeats")
    for seed in range(3):
        answers = asyncio.run(send_together(router.url, burst_bodies(seed)))
        assert [a.status_code for a in answers] == [200] * BURST
        chosen = [a.headers["x-kvscale-replica"] for a in answers]
        predicted = sorted(int(a.headers["x-kvscale-predicted-hit-tokens"]) for a in answers)
        # One decision found nothing (the first); every later one found the prefix predicted.
        assert len(set(chosen)) == 1 and predicted[0] == 0 and predicted[1] >= 16 * 16, (seed, chosen, predicted)
