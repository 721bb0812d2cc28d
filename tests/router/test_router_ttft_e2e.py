"""The default policy (predicted-ttft) in front of real replicas: multi-turn chats route to the
replica holding the whole conversation (answers included, through KV events), and real replicas
heartbeat the measured rates the policy needs."""

from __future__ import annotations

import json

import openai
import pytest
import redis

from kvscale.block_hash import hash_prompt_blocks
from kvscale.kv_index_schema import blocks_key, heartbeat_key
from kvscale.model_files import load_tokenizer, resolve_model_path
from kvscale.processes import wait_until
from kvscale.tokenization import chat_prompt_token_ids
from tests.router.conftest import index_blocks

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
BLOCK = 16


def test_a_follow_up_turn_routes_to_the_replica_holding_the_answer(replicas, session_redis, launcher):
    router = launcher.router([r.url for r in replicas], session_redis.url, policy="predicted-ttft")
    tokenizer = load_tokenizer(resolve_model_path(None))
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused")
    history = [{"role": "user", "content": "List five colours of the rainbow, one per line, with a sentence on each."}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, max_tokens=48, temperature=0)
    holder = first.headers["x-kvscale-replica"]
    answer = first.parse().choices[0].message.content
    turn_one = chat_prompt_token_ids(tokenizer, history)
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now the other two."}]
    turn_two = chat_prompt_token_ids(tokenizer, history)
    assert turn_two[: len(turn_one)] == turn_one
    # The router's predictions cover turn one's prompt only; a block beyond it can only be known
    # from the replica's KV events for the answer. Wait until the replica has published those.
    answer_blocks = len(turn_one) // BLOCK + 1
    hashes = hash_prompt_blocks(turn_two, BLOCK)[: answer_blocks + 1]
    assert len(hashes) == answer_blocks + 1, "the answer is too short to fill a block"
    store = redis.Redis.from_url(session_redis.url)
    wait_until(lambda: all(store.smismember(blocks_key(holder), hashes)), 20, what="answer blocks in Redis")
    # The router learns them from Redis as its events arrive or, after a Redis call timed out (50 ms
    # by default; a loaded host), as it reloads: routed once its index has caught up. A router that
    # never read them would never get there.
    wait_until(lambda: index_blocks(router.url, holder) == store.scard(blocks_key(holder)), 20,
               what="the router's index caught up with Redis")
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert second.headers["x-kvscale-replica"] == holder
    # The estimate it routed by, reported so that its error can be measured.
    assert float(second.headers["x-kvscale-predicted-ttft-ms"]) > 0
    assert float(second.headers["x-kvscale-predicted-ttft-uncalibrated-ms"]) > 0  # and before calibration
    predicted = int(second.headers["x-kvscale-predicted-hit-tokens"])
    assert predicted >= (answer_blocks + 1) * BLOCK, (predicted, len(turn_one), len(turn_two))
    # The replica really had them: its own prefix cache served at least as much.
    details = second.parse().usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= (answer_blocks + 1) * BLOCK

    # The heartbeat carries what the policy predicts with, measured by the replica.
    beat = json.loads(store.get(heartbeat_key(holder)))
    assert beat["prefill_tokens_per_s"] > 0 and beat["decode_step_s"] > 0 and beat["step_token_budget"] > 0
    assert beat["prefill_tokens_waiting"] >= 0 and beat["num_decoding"] >= 0
