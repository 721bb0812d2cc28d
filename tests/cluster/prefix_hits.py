"""The check that a router's prefix index predicts what a server then counts, shared by the
whole-platform tests (process runtime and node): the router answers each request with the hit
tokens it expected (``x-kvscale-predicted-hit-tokens``); the servers count what they found in
their cache (``PREFIX_CACHE_HITS``). The two agree, within a block, only when the router's index
holds the replica under the very URL the server publishes its KV events for."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import httpx
import openai
from metrics_text import samples

from kvscale.metric_names import PREFIX_CACHE_HITS


def server_hits(server_urls: Sequence[str], timeout: float = 10.0) -> float:
    """Prefix-cache hit tokens counted so far by every server of ``server_urls`` together."""
    return sum(sum(samples(httpx.get(f"{url}/metrics", timeout=timeout).text, PREFIX_CACHE_HITS.series).values())
               for url in server_urls)


def assert_predicted_hits_counted(client: openai.OpenAI, model: str, prompt: str, server_urls: Sequence[str],
                                  *, block_size: int, settle_s: float,
                                  diagnosis: Callable[[], str] = lambda: "") -> int:
    """Send ``prompt`` once, wait ``settle_s`` (its KV events reach Redis and the router's index),
    send it again: the router's prediction for the second is positive and within one block of the
    hits the servers count for it. Returns the prediction."""
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    time.sleep(settle_s)
    before = server_hits(server_urls)
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    predicted = int(raw.headers["x-kvscale-predicted-hit-tokens"])
    counted = server_hits(server_urls) - before
    assert predicted > 0 and abs(predicted - counted) <= block_size, (predicted, counted, diagnosis())
    return predicted
