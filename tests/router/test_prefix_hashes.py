"""A request's prompt as the router hashes it: chat turns with and without the token cache,
completions, block sizes learned from heartbeats, and the prompts it cannot hash."""

from __future__ import annotations

import pytest

from kvscale.block_hash import hash_prompt_blocks
from kvscale.router.prefix_hashes import PrefixHasher, PromptBlocks
from kvscale.tokenization import completion_prompt_token_ids


@pytest.fixture(scope="module")
def hasher() -> PrefixHasher:
    hasher = PrefixHasher([None])
    hasher.load_tokenizers()  # the bundled model's tokenizer, as the router's start() loads it
    return hasher


def test_chat_turns_hash_alike_with_and_without_the_cache(hasher: PrefixHasher) -> None:
    cached, plain = PrefixHasher([None]), PrefixHasher([None], chat_cache_tokens=0)
    for each in (cached, plain):
        each.load_tokenizers()
    (name,) = cached.chat_caches
    assert cached.chat_caches[name].enabled and not plain.chat_caches[name].enabled
    content = "Read this: " + "golf hotel india " * 30 + "\nWhat repeats?"
    messages = [{"role": "user", "content": content}]
    for turn in range(4):
        body = {"model": None, "messages": messages, "cache_salt": "w4"}
        expected = plain.prompt_block_hashes("chat", body, None)
        assert cached.prompt_block_hashes("chat", body, None) == expected
        messages = [*messages, {"role": "assistant", "content": f"answer {turn}"},
                    {"role": "user", "content": f"question {turn}?"}]
    assert cached.chat_caches[name].hit_tokens > 0
    # A hasher given a tokenizer directly builds its cache on first use.
    bare = PrefixHasher([None])
    bare.tokenizers[name] = hasher.tokenizers[name]
    body = {"model": None, "messages": messages}
    expected = plain.prompt_block_hashes("chat", body, None)
    assert bare.prompt_block_hashes("chat", body, None) == expected
    assert bare.chat_caches[name].enabled


def test_a_completion_batch_is_hashed_by_its_first_prompt_at_the_models_block_size(
    hasher: PrefixHasher,
) -> None:
    (name,) = hasher.tokenizers
    prompt = "The lighthouse keeper counted ships " * 8
    ids = completion_prompt_token_ids(hasher.tokenizers[name], prompt)
    body = {"model": name, "prompt": [prompt, "another prompt"], "cache_salt": "s"}
    assert hasher.prompt_block_hashes("completions", body, name) == PromptBlocks(
        hash_prompt_blocks(ids, 16, cache_salt="s"), len(ids), 16)
    learned = PrefixHasher([None])
    learned.tokenizers = hasher.tokenizers
    learned.block_sizes[name] = 4  # as a heartbeat reports it
    assert learned.prompt_block_hashes("completions", body, name).hashes == hash_prompt_blocks(
        ids, 4, cache_salt="s")


def test_prompts_it_cannot_hash_get_no_hashes_and_say_why(hasher: PrefixHasher) -> None:
    reasons: list[str] = []
    each = PrefixHasher([None], default_block_size=8, on_fallback=reasons.append)
    assert each.prompt_block_hashes("completions", {"prompt": "hi"}, None) == PromptBlocks([], 0, 8)
    each.tokenizers = hasher.tokenizers
    # A malformed conversation: the replica answers with its own error.
    assert each.prompt_block_hashes("chat", {"messages": "nope"}, None) == PromptBlocks([], 0, 8)
    assert each.prompt_block_hashes("completions", {"no_prompt": 1}, None).hashes == []
    assert reasons == ["no_tokenizer", "untokenizable", "untokenizable"]
