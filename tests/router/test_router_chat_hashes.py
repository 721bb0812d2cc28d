"""The router must hash a chat request's blocks exactly as the server caches
them, for every message shape the API accepts (else such requests silently lose affinity).

Server side: the request body parsed by the API's own schema and turned into token ids by the
server's handler code. Router side: the raw JSON body through the router's own code path
(``kvscale.router.prefix_hashes``).
"""

from __future__ import annotations

import pytest

from kvscale.block_hash import hash_prompt_blocks
from kvscale.router.prefix_hashes import PrefixHasher
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.serving import OpenAIServer
from kvscale.server.entrypoints.serving_chat import chat_ids

BLOCK_SIZE = 4  # small blocks: every shape below spans several
LONG = "Summarise the plot of a novel about a lighthouse keeper who counts ships at night."

SHAPES: dict[str, list[dict]] = {
    "string content": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": LONG},
    ],
    "one text part": [{"role": "user", "content": [{"type": "text", "text": LONG}]}],
    "several text parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": LONG}, {"type": "text", "text": " Now."}]},
    ],
    "null content": [
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Go on."},
    ],
    "missing content": [{"role": "user", "content": LONG}, {"role": "assistant"}, {"role": "user", "content": "More."}],
    "empty content": [{"role": "system", "content": ""}, {"role": "user", "content": LONG}],
    "named participant": [{"role": "user", "content": LONG, "name": "alice"}],
    "multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": "A keeper counts ships."},
        {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
    ],
    "assistant tool call and tool answer": [
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"ships\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42 ships"},
        {"role": "user", "content": "So how many?"},
    ],
    "developer instructions": [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": LONG},
    ],
}


@pytest.fixture(scope="module")
def hasher() -> PrefixHasher:
    hasher = PrefixHasher([None], default_block_size=BLOCK_SIZE)
    hasher.load_tokenizers()  # what the router's start() does
    return hasher


@pytest.fixture(scope="module")
def server(hasher: PrefixHasher) -> OpenAIServer:
    (tokenizer,) = hasher.tokenizers.values()
    return OpenAIServer(None, tokenizer=tokenizer, served_model_names=["m"], max_model_len=2048)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_router_predicts_the_servers_block_hashes(
    shape: str, hasher: PrefixHasher, server: OpenAIServer
) -> None:
    body = {"model": None, "messages": SHAPES[shape]}
    request = p.ChatCompletionRequest.model_validate(body)  # the API accepts this shape
    server_ids = chat_ids(server, request.messages)
    expected = hash_prompt_blocks(server_ids, BLOCK_SIZE)
    assert len(expected) >= 3

    hashes, prompt_tokens, block_size = hasher.prompt_block_hashes("chat", body, None)
    assert block_size == BLOCK_SIZE
    assert prompt_tokens == len(server_ids)
    assert hashes == expected


def test_cache_salt_is_hashed_alike(hasher: PrefixHasher, server: OpenAIServer) -> None:
    body = {"messages": SHAPES["one text part"], "cache_salt": "tenant-a"}
    request = p.ChatCompletionRequest.model_validate(body)
    expected = hash_prompt_blocks(chat_ids(server, request.messages), BLOCK_SIZE, cache_salt="tenant-a")
    assert hasher.prompt_block_hashes("chat", body, None).hashes == expected


def test_a_shape_the_api_rejects_is_not_guessed(hasher: PrefixHasher) -> None:
    """An image part is a 400 at the replica; the router must not invent hashes for it."""
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(ValueError):
        p.ChatCompletionRequest.model_validate(body)
    assert hasher.prompt_block_hashes("chat", body, None).hashes == []
