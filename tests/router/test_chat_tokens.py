"""The router's chat token cache gives exactly the one-shot tokenization's ids and block hashes.

Reference: ``kvscale.tokenization.chat_prompt_token_ids`` (what the server runs) and
``hash_prompt_blocks``, with the bundled model's own tokenizer and chat template. Conversations
grow turn by turn through one cache, so later turns are served from cached prefixes.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvscale.block_hash import hash_prompt_blocks
from kvscale.router.chat_tokens import ChatTokenCache, special_token_pattern
from kvscale.router.prefix_hashes import PrefixHasher
from kvscale.tokenization import chat_prompt_token_ids

PIECES = ["Hello", " world", "!", "\n", "\n\n", "  ", "\t", "Ünïcödé", " 漢字", "🙂", "42", " 3.14", "don't",
          " <|im_end|> ", "<|im_start|>", "assistant", "<|endoftext|>", " ", ".", "?", "—", "<", "|", ">",
          "ing", " the", "The", "\r\n", "end "]


@pytest.fixture(scope="module")
def tokenizer():
    hasher = PrefixHasher([None])
    hasher.load_tokenizers()  # the bundled model's tokenizer, as the router loads it
    (tokenizer,) = hasher.tokenizers.values()
    return tokenizer


def random_text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, pieces)))


def check(cache: ChatTokenCache, messages: list[dict], block_size: int = 16, salt: str | None = None) -> None:
    ids, hashes = cache.prompt(messages, block_size, salt)
    expected = chat_prompt_token_ids(cache.tokenizer, messages)
    assert ids == expected
    assert hashes == hash_prompt_blocks(expected, block_size, cache_salt=salt)


def test_the_bundled_tokenizer_passes_its_self_check(tokenizer) -> None:
    cache = ChatTokenCache(tokenizer)
    assert cache.enabled
    assert len(cache) == 0  # the self-check leaves nothing behind
    pattern = special_token_pattern(tokenizer)
    assert pattern is not None and pattern.search("x<|im_end|>y").end() == len("x<|im_end|>")


def test_follow_up_turns_match_the_one_shot_tokenization_over_many_shapes(tokenizer) -> None:
    """200 random conversations of 1-8 turns, interleaved, some with a system or developer
    message, text parts, empty or null content, special-token strings inside messages."""
    rng = random.Random(7)
    cache = ChatTokenCache(tokenizer)
    conversations = []
    for _ in range(200):
        head = []
        kind = rng.random()
        if kind < 0.3:
            head.append({"role": "system", "content": random_text(rng, 12)})
        elif kind < 0.4:
            head.append({"role": "developer", "content": random_text(rng, 6)})
        conversations.append({"messages": head, "turns": rng.randint(1, 8)})
    checked = 0
    while conversations:
        conv = rng.choice(conversations)
        question: object = random_text(rng, 20)
        if rng.random() < 0.15:
            question = [{"type": "text", "text": random_text(rng, 5)}, {"type": "text", "text": random_text(rng, 5)}]
        conv["messages"] = [*conv["messages"], {"role": "user", "content": question}]
        salt = rng.choice([None, "tenant-a"])
        check(cache, conv["messages"], block_size=rng.choice([1, 4, 16]), salt=salt)
        checked += 1
        conv["turns"] -= 1
        if conv["turns"] == 0:
            conversations.remove(conv)
            continue
        answer = rng.choice([random_text(rng, 15), None, ""])
        conv["messages"].append({"role": "assistant", "content": answer})
    assert checked > 500
    # Most of those prompts came from the cache: the check above ran on the incremental path.
    assert cache.hit_tokens > 10_000


def test_a_regenerated_or_edited_turn_and_a_shared_history_match_too(tokenizer) -> None:
    cache = ChatTokenCache(tokenizer)
    document = "Read this: " + " ".join(["alpha bravo charlie"] * 40)
    history = [{"role": "user", "content": document}, {"role": "assistant", "content": "Done."}]
    for question in ("Summarise.", "Summarise.", "Summarise it again.", "What is the third word?"):
        check(cache, [*history, {"role": "user", "content": question}])
    check(cache, [*history[:1], {"role": "assistant", "content": "Done!"}, {"role": "user", "content": "Hm?"}])
    check(cache, [{"role": "user", "content": document}])  # a new conversation on the same document
    check(cache, [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "Go."}])
    assert cache.hit_tokens > 0


def test_block_size_or_salt_changes_rehash_the_cached_prefix(tokenizer) -> None:
    cache = ChatTokenCache(tokenizer)
    turn1 = [{"role": "user", "content": "Tell me about lighthouses and the keepers who run them."}]
    turn2 = [*turn1, {"role": "assistant", "content": "They keep lights."}, {"role": "user", "content": "More."}]
    check(cache, turn1, block_size=4, salt="a")
    check(cache, turn2, block_size=4, salt="b")  # same ids, other salt: every hash differs
    check(cache, turn2, block_size=8, salt="b")
    check(cache, turn2, block_size=8, salt=None)


def test_the_token_bound_evicts_least_recently_used_entries(tokenizer) -> None:
    cache = ChatTokenCache(tokenizer, max_tokens=300)
    assert cache.enabled
    for i in range(30):
        check(cache, [{"role": "user", "content": f"conversation {i}: " + "words " * 20}])
        assert cache._held <= 300
    assert 0 < len(cache) < 30


def test_a_cache_of_zero_tokens_is_off_and_still_exact(tokenizer) -> None:
    cache = ChatTokenCache(tokenizer, max_tokens=0)
    assert not cache.enabled
    check(cache, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Bye"}])
    assert len(cache) == 0 and cache.hit_tokens == 0


def test_messages_the_template_cannot_take_raise_as_the_one_shot_path_does(tokenizer) -> None:
    cache = ChatTokenCache(tokenizer)
    for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}]):
        with pytest.raises(ValueError):
            cache.prompt(bad, 16, None)


def _trained_tokenizer(prepend_scheme: str) -> PreTrainedTokenizerFast:
    """A real SentencePiece-style BPE tokenizer, trained here on a few words."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    corpus = ["hello there assistant user system what next", "the quick brown fox", "assistant\nuser\n"]
    backend.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = (
        "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
    return tokenizer


def test_a_special_token_that_swallows_the_whitespace_after_it_is_no_cut_point() -> None:
    tokenizer = _trained_tokenizer("always")
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken("<|im_end|>", rstrip=True, special=True, normalized=False)]})
    pattern = special_token_pattern(tokenizer)
    assert pattern is not None and pattern.search("a<|im_end|>\n") is None
    assert pattern.search("a<|im_start|>b").end() == len("a<|im_start|>")
    cache = ChatTokenCache(tokenizer)
    assert cache.enabled
    messages = [{"role": "user", "content": "hello there "}]
    for answer in ("the fox ", " brown"):
        check(cache, messages, block_size=4)
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": " what next"}]
    check(cache, messages, block_size=4)
    assert cache.hit_tokens > 0


def test_a_tokenizer_that_treats_a_texts_first_piece_differently_turns_the_cache_off() -> None:
    """Metaspace with prepend_scheme="first" prepends "▁" only at the very start of a text, so a
    prompt cut after a special token encodes differently: the self-check must notice."""
    tokenizer = _trained_tokenizer("first")
    cache = ChatTokenCache(tokenizer)
    assert not cache.enabled
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the fox"},
                {"role": "user", "content": "what next"}]
    for _ in range(2):
        check(cache, messages)  # off: the one-shot tokenization, every time
    assert cache.hit_tokens == 0


def test_a_sentencepiece_style_tokenizer_that_prepends_to_every_piece_keeps_the_cache() -> None:
    cache = ChatTokenCache(_trained_tokenizer("always"))
    assert cache.enabled
    messages = [{"role": "user", "content": "hello there"}]
    for answer, question in (("the fox", "what next"), ("brown", "user system")):
        check(cache, messages)
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    check(cache, messages)
    assert cache.hit_tokens > 0


def test_the_cli_flag_sets_the_bound_and_rejects_a_negative_one() -> None:
    from kvscale.cli import build_parser
    from kvscale.router.cli_router import config_from_args

    parse = build_parser("router").parse_args
    assert config_from_args(parse(["router", "--replicas", "http://a:1"])).chat_cache_tokens > 0
    assert config_from_args(parse(["router", "--replicas", "http://a:1", "--chat-cache-tokens", "0"])).chat_cache_tokens == 0
    with pytest.raises(SystemExit, match="chat-cache-tokens"):
        config_from_args(parse(["router", "--replicas", "http://a:1", "--chat-cache-tokens", "-1"]))


def test_tool_turns_render_in_the_configured_tool_call_format(tokenizer) -> None:
    """The servers render tools and tool calls in their --tool-call-parser format; a cache told
    the same format gives their ids, whatever the format."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
                {"role": "user", "content": "And tomorrow?"}]
    rendered = {}
    for tool_format in ("hermes", "llama3_json"):
        cache = ChatTokenCache(tokenizer, tool_format=tool_format)
        for _ in range(2):  # a miss, then the turn served from the cache
            ids, _ = cache.prompt(messages, 16, None, tools)
            assert ids == chat_prompt_token_ids(tokenizer, messages, tools, tool_format)
        rendered[tool_format] = ids
    assert rendered["hermes"] != rendered["llama3_json"]
    hasher = PrefixHasher([None], tool_format="llama3_json")
    hasher.load_tokenizers()
    (cache,) = hasher.chat_caches.values()
    assert cache.prompt(messages, 16, None, tools)[0] == rendered["llama3_json"]
