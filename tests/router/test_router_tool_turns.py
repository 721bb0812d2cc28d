"""An agent's two-turn tool conversation through the router: the second turn's prompt
holds the assistant's call and the tool's result, rendered by the contract the router and the
server share (kvscale.tokenization), so the router's predicted prefix hits for it are the hits the
replica counts, within one block.

Real router, real `kvscale serve` replicas of the bundled model (the session's two), real Redis.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest
import redis

from kvscale.block_hash import hash_prompt_blocks
from kvscale.kv_index_schema import blocks_key
from kvscale.model_files import load_tokenizer, resolve_model_path
from kvscale.processes import wait_until
from kvscale.tokenization import chat_prompt_token_ids
from tests.router.conftest import index_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from prefix_hits import server_hits  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
BLOCK = 16

# The lighthouse is an enum so the forced call is bounded: a free string let greedy decoding run
# on inside it to max_tokens (finish "length", no call to answer) whenever a rounding change
# moved the small model's path, and this test is about the second turn's prefix, not the call.
TOOL = {"type": "function", "function": {
    "name": "count_ships",
    "description": "How many ships passed a lighthouse on a given night.",
    "parameters": {"type": "object", "properties": {
        "lighthouse": {"type": "string", "enum": ["North Point", "South Point"]},
        "night": {"type": "integer", "minimum": 1, "maximum": 31}},
        "required": ["lighthouse", "night"], "additionalProperties": False}}}


def test_second_turn_of_a_tool_conversation_is_predicted_as_the_replica_counts(replicas, session_redis, launcher):
    router = launcher.router([r.url for r in replicas], session_redis.url)
    by_id = {f"replica-{i}": r for i, r in enumerate(replicas)}
    # Until a replica's first heartbeat the router knows it by its address, which its KV events
    # in Redis do not carry (router/replicas.py): the turns are routed once both are named.
    wait_until(lambda: {r["id"] for r in httpx.get(f"{router.url}/health").json()["replicas"]} == set(by_id), 30,
               what="the router's replicas named by their heartbeats")
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": "You keep the harbour log of the North Point lighthouse."},
                {"role": "user", "content": "How many ships passed the North Point lighthouse on night 12?"}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=96,
        temperature=0)
    holder = first.headers["x-kvscale-replica"]
    choice = first.parse().choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "SHIPS-17"}]

    # The prompt the replica renders holds the call and its result, and is token for token what
    # the router renders from the raw JSON body.
    replica = by_id[holder]
    served = httpx.post(f"{replica.url}/tokenize", json={"model": MODEL, "messages": history, "tools": [TOOL]},
                        timeout=60).json()["tokens"]
    text = httpx.post(f"{replica.url}/detokenize", json={"tokens": served}, timeout=60).json()["prompt"]
    assert "<tool_call>" in text and call.function.name in text and "SHIPS-17" in text
    tokenizer = load_tokenizer(resolve_model_path(None))
    assert chat_prompt_token_ids(tokenizer, history, [TOOL]) == served
    turn_one = chat_prompt_token_ids(tokenizer, messages, [TOOL])
    assert served[: len(turn_one)] == turn_one

    # Predictions must come from the replica's KV events too, not only the router's own memory of
    # turn one: wait until every full block of turn one's prompt is in Redis.
    hashes = hash_prompt_blocks(turn_one, BLOCK)
    assert len(hashes) >= 4, len(turn_one)
    store = redis.Redis.from_url(session_redis.url)
    wait_until(lambda: all(store.smismember(blocks_key(holder), hashes)), 20, what="turn one's blocks in Redis")
    # The router's own predictions for turn one lapse after 10 s (a slow first turn on a loaded
    # host outlasts them); its index learns the blocks from Redis as events arrive or, after a
    # Redis call timed out (50 ms by default), as it reloads: the turn is sent once the index has
    # caught up. A router that never read them would never get there.
    wait_until(lambda: index_blocks(router.url, holder) == store.scard(blocks_key(holder)), 20,
               what="the router's index caught up with Redis")

    before = {rid: server_hits([r.url]) for rid, r in by_id.items()}
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, tools=[TOOL], tool_choice="none", max_tokens=4, temperature=0)
    assert second.headers["x-kvscale-replica"] == holder
    predicted = int(second.headers["x-kvscale-predicted-hit-tokens"])
    counted = server_hits([replica.url]) - before[holder]
    assert predicted >= len(hashes) * BLOCK - BLOCK, (predicted, len(turn_one))
    assert abs(predicted - counted) <= BLOCK, (predicted, counted)
    assert second.parse().usage.prompt_tokens == len(served)
    # The other replica counted nothing for it.
    assert all(server_hits([r.url]) == before[rid] for rid, r in by_id.items() if rid != holder)
