"""/v1/responses through the router: the prompt it hashes for a Responses turn is token for token
the one the replica builds (the stored conversation, then the turn), so each turn after the first
goes to the replica holding the conversation's prefix and is answered from its cache; GET and
DELETE /v1/responses/{id} reach the store the replicas share.

Real router, two real `kvscale serve` replicas of the bundled model storing responses in one real
Redis, the official `openai` client's `responses` resource.
"""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from kvscale import request_limits
from kvscale.model_files import load_tokenizer, resolve_tokenizer_path
from kvscale.processes import free_port, wait_until
from kvscale.responses_messages import MAX_INPUT_ITEMS, Unreadable
from kvscale.responses_store_schema import record_conversation, record_key
from kvscale.router import responses
from kvscale.server.entrypoints.protocol_responses import ResponsesRequest
from kvscale.server.entrypoints.responses_input import chat_request
from kvscale.tokenization import chat_prompt_token_ids
from tests.router.conftest import BLOCK_SIZE, MODEL, REPLICA_BLOCKS, Proc, spawn, spawn_router

TOOL = {"type": "function", "name": "count_ships", "description": "Ships past a lighthouse on a night.",
        "parameters": {"type": "object", "properties": {"night": {"type": "integer"}}, "required": ["night"]}}
HISTORY = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
BODIES = [
    {"input": "Hello!"},
    {"input": "And another?", "instructions": "You are terse."},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Two "}, {"type": "input_text", "text": "parts"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yes."}]},
               {"role": "developer", "content": "Be brief."}]},
    {"input": [{"role": "user", "content": "Ships on night 12?"},
               {"type": "function_call", "call_id": "call_1", "name": "count_ships", "arguments": '{"night": 12}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "17"}],
     "tools": [TOOL, {**TOOL, "name": "other", "strict": False, "description": None}]},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_tokenizer_path(None))


@pytest.mark.parametrize("history", [[], HISTORY], ids=["first-turn", "next-turn"])
@pytest.mark.parametrize("body", BODIES, ids=["text", "instructions", "parts", "tools"])
def test_the_router_builds_the_prompt_the_replica_builds(tokenizer, body, history) -> None:
    chat, _ = chat_request(ResponsesRequest.model_validate(body), history, request_limits.FieldLimits())
    served = chat_prompt_token_ids(tokenizer, [m.model_dump(exclude_none=True) for m in chat.messages],
                                   [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None)
    routed = responses.chat_body(body, history)
    assert chat_prompt_token_ids(tokenizer, routed["messages"], routed.get("tools")) == served


@pytest.mark.parametrize("body", [
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    {"input": [{"type": "web_search_call"}]},
    {"input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)},
    {"input": "x", "tools": [{"type": "web_search"}]},
    {"input": 7},
], ids=["image", "unknown-item", "too-many-items", "built-in-tool", "not-input"])
def test_a_request_the_router_cannot_read_is_not_hashed(body) -> None:
    with pytest.raises(Unreadable):
        responses.chat_body(body, [])


def test_the_key_a_router_reads_is_the_one_a_replica_stores_under() -> None:
    from kvscale.server.entrypoints.responses_store import StoredResponse

    record = StoredResponse({"id": "resp_1"}, HISTORY).to_bytes()
    assert record_conversation(record) == HISTORY
    assert record_conversation(b"[1]") is None and record_conversation(b"not json") is None
    assert record_key("m", "resp_1") == "kvscale:responses:m:record:resp_1"
    assert responses.store_model("alias", [["first", "alias"]]) == "first"
    assert responses.store_model(None, [["first"]]) == "first"
    assert responses.store_model("unknown", [["first"]]) is None
    assert responses.previous_id({"previous_response_id": "r" * 129}) is None


def _replica(redis_url: str, name: str, port: int) -> Proc:
    return spawn(["serve", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK_SIZE),
                  "--num-gpu-blocks-override", str(REPLICA_BLOCKS), "--max-model-len", "512", "--redis", redis_url,
                  "--replica-id", name, "--responses-store", "redis"], port, name)


@pytest.fixture(scope="module")
def fleet(session_redis):
    """Two replicas storing responses in the session's Redis and a router over them, started at
    once; the router is used once it sees both replicas ready."""
    started: list[Proc] = []
    ports = [free_port(), free_port()]
    try:
        with ThreadPoolExecutor(3) as pool:
            # The stored conversation is read from Redis within --redis-timeout-ms; the default 50 ms
            # read as a miss (no prefix predicted) beside a loaded suite.
            router = pool.submit(spawn_router, [f"http://127.0.0.1:{port}" for port in ports], session_redis.url,
                                 health_path="/ping", extra=["--redis-timeout-ms", "1000"])
            replicas = [pool.submit(_replica, session_redis.url, f"responses-{i}", port) for i, port in enumerate(ports)]
            for future in [*replicas, router]:
                with contextlib.suppress(Exception):
                    started.append(future.result())
            for future in [*replicas, router]:
                future.result()  # raises the first failure to start
        url = started[-1].url
        # Ready, and named by their heartbeats: until a replica's first heartbeat binds its id the
        # router names it by address, and a conversation's turns would seem to move.
        wait_until(lambda: sum(r["healthy"] and r["id"].startswith("responses-")
                               for r in httpx.get(f"{url}/health", timeout=5).json()["replicas"]) == 2,
                   60, what="the router to see both replicas ready, named by their heartbeats")
        yield started
    finally:
        for proc in started:
            proc.stop()


def _turn(client: openai.OpenAI, stream: bool, **fields: Any) -> tuple[str, int, Any]:
    """(the replica that answered, the router's predicted hit tokens, the response)."""
    raw = client.responses.with_raw_response.create(model=MODEL, max_output_tokens=6, temperature=0,
                                                    stream=stream, **fields)
    parsed = raw.parse()
    if stream:
        events = list(parsed)
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        parsed = events[-1].response
    return raw.headers["x-kvscale-replica"], int(raw.headers["x-kvscale-predicted-hit-tokens"]), parsed


def test_a_conversation_stays_on_the_replica_holding_its_prefix(fleet) -> None:
    *replicas, router = fleet
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
    opening = ("You are the keeper of the North Point lighthouse log. Every night you write down the ships "
               "that passed, their flags and the weather. Tonight three ships passed in fog. Name one.")
    holder, _, previous = _turn(client, False, input=opening)
    for turn, question in enumerate(["Name another.", "What flag did it fly?", "And the weather?"]):
        replica, predicted, answer = _turn(client, turn % 2 == 0, input=question, previous_response_id=previous.id,
                                           include=["message.output_text.logprobs"], top_logprobs=1)
        assert answer.status in ("completed", "incomplete") and answer.output_text
        logprobs = answer.output[0].content[0].logprobs  # passed through, streamed or not
        assert len(logprobs) == answer.usage.output_tokens and len(logprobs[0].top_logprobs) == 1
        assert replica == holder
        # The previous turn's whole prompt, in full blocks, was predicted and found in the cache.
        held = previous.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE
        assert predicted >= held, (turn, predicted, previous.usage)
        assert answer.usage.input_tokens_details.cached_tokens >= held, (turn, answer.usage)
        assert answer.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens
        previous = answer

    # Stored responses through the router: read and deleted in the store the replicas share.
    assert client.responses.retrieve(previous.id).output_text == previous.output_text
    deleted = client.responses.with_raw_response.delete(previous.id)
    assert deleted.http_response.json() == {"id": previous.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous.id)
    # A deleted previous response: the replica's own error, through the router.
    body = {"model": MODEL, "input": "More?", "previous_response_id": previous.id, "max_output_tokens": 1}
    routed = httpx.post(f"{router.url}/v1/responses", json=body, timeout=60)
    direct = httpx.post(f"{replicas[0].url}/v1/responses", json=body, timeout=60)
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())
    assert routed.json()["error"]["code"] == "previous_response_not_found"


def test_the_router_reads_what_a_replica_stored(fleet, session_redis) -> None:
    import redis

    *_, router = fleet
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=2, temperature=0)
    stored = redis.Redis.from_url(session_redis.url).get(record_key(MODEL, first.id))
    conversation = record_conversation(stored)
    assert conversation is not None and conversation[0] == {"role": "user", "content": "Name a colour."}
    assert json.loads(stored)["response"]["id"] == first.id


def test_a_responses_request_is_charged_its_max_output_tokens_and_settled_by_its_usage() -> None:
    from kvscale.router.rate_limits import request_tokens, usage_tokens

    assert request_tokens("responses", {"max_output_tokens": 5}, 10, 0) == 15
    assert request_tokens("responses", {}, 10, 0) == 10
    tail = (b'"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},'
            b'"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":15}}')
    assert usage_tokens(tail) == 15
