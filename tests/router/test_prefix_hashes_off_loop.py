"""The router's prompt hashing as the event loop sees it: a long prompt is tokenized, rendered and
hashed off the loop (other streams keep flowing), and a request without "model" is hashed with
the block size of the model it goes to."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from kvscale.block_hash import hash_prompt_blocks
from kvscale.router.prefix_hashes import PrefixHasher
from kvscale.tokenization import completion_prompt_token_ids

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet".split()


@pytest.fixture(scope="module")
def hasher() -> PrefixHasher:
    hasher = PrefixHasher([None])
    hasher.load_tokenizers()
    return hasher


def longest_gap_while(awaitable_factory, tick_s: float = 0.002) -> tuple[float, object]:
    """Run a ticker beside the awaitable: the longest the event loop left it waiting, as a stream's
    next chunk would wait, and the awaitable's result."""

    async def scenario() -> tuple[float, object]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(tick_s)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        result = await awaitable_factory()
        stop.set()
        await task
        return max(gaps), result

    return asyncio.run(scenario())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_long_prompt_is_hashed_off_the_event_loop(hasher: PrefixHasher, endpoint: str) -> None:
    text = " ".join(random.Random(0).choice(WORDS) + str(i % 97) for i in range(40_000))  # ~100k tokens
    body = {"prompt": text} if endpoint == "completions" else {"messages": [{"role": "user", "content": text}]}
    started = time.perf_counter()
    expected = PrefixHasher([None], chat_cache_tokens=0)
    expected.tokenizers = hasher.tokenizers
    inline = expected.prompt_block_hashes(endpoint, body, None)
    inline_s = time.perf_counter() - started
    assert inline.prompt_tokens > 90_000 and inline_s > 0.05

    async def hashed() -> object:
        return await hasher.prompt_block_hashes_off_loop(endpoint, body, None, len(json.dumps(body)))

    # On the loop, one gap would be the whole of inline_s; off it, the loop keeps ticking.
    gap, result = longest_gap_while(hashed)
    assert result == inline
    assert gap < inline_s / 3, f"the loop stalled {gap * 1000:.0f} ms (hashing takes {inline_s * 1000:.0f} ms)"
    if endpoint == "chat":
        (name,) = hasher.chat_caches
        assert len(hasher.chat_caches[name]) == 0  # the thread left the loop's chat cache alone


def test_a_short_prompt_is_hashed_in_place(hasher: PrefixHasher) -> None:
    """Handing a short prompt to a thread costs more than hashing it: it is hashed on the loop
    (the same answer, and the chat token cache keeps serving follow-up turns)."""
    body = {"messages": [{"role": "user", "content": "a short question"}]}

    async def hashed() -> object:
        return await hasher.prompt_block_hashes_off_loop("chat", body, None, len(json.dumps(body)))

    assert asyncio.run(hashed()) == hasher.prompt_block_hashes("chat", body, None, chat_cache=False)
    (name,) = hasher.chat_caches
    assert len(hasher.chat_caches[name]) == 1


def test_a_request_without_model_is_hashed_with_its_models_block_size(hasher: PrefixHasher) -> None:
    """The replicas' heartbeats say the (only) model uses 32-token blocks; a request that names no
    model goes to it and must be hashed as its replicas hash it, not with the default 16."""
    (name,) = hasher.tokenizers
    learned = PrefixHasher([None])
    learned.tokenizers = hasher.tokenizers
    learned.block_sizes[name] = 32  # as a heartbeat reports it
    prompt = "The lighthouse keeper counted ships " * 16
    ids = completion_prompt_token_ids(hasher.tokenizers[name], prompt)
    blocks = learned.prompt_block_hashes("completions", {"prompt": prompt}, None)
    assert blocks.block_size == 32
    assert blocks.hashes == hash_prompt_blocks(ids, 32)


def test_a_request_naming_another_of_the_models_served_names_gets_its_block_size(hasher: PrefixHasher) -> None:
    """The servers answer to "chat" and "chat-v2" (--served-model-name chat chat-v2); their
    heartbeats name the model by its first name only. A request for "chat-v2" goes to the same
    replicas and must be hashed with the same 32-token blocks, not the default 16."""
    (name,) = hasher.tokenizers
    aliased = PrefixHasher([None], served_names=["chat", "chat-v2"])
    aliased.tokenizers = {"chat": hasher.tokenizers[name], "chat-v2": hasher.tokenizers[name]}
    aliased.block_sizes["chat"] = 32  # as the heartbeats report it
    prompt = "The lighthouse keeper counted ships " * 16
    ids = completion_prompt_token_ids(hasher.tokenizers[name], prompt)
    for model in ("chat", "chat-v2", None):
        blocks = aliased.prompt_block_hashes("completions", {"prompt": prompt}, model)
        assert blocks.block_size == 32, model
        assert blocks.hashes == hash_prompt_blocks(ids, 32)
