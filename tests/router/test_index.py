"""The router's in-memory prefix index, fed with the engine's own block hashes."""

from __future__ import annotations

from kvscale.block_hash import hash_prompt_blocks
from kvscale.router.index import PrefixIndex, prediction_ttl


def test_match_counts_leading_blocks_only():
    index = PrefixIndex()
    prompt = hash_prompt_blocks(list(range(64)), 16)  # 4 blocks
    index.stored("a", prompt[:3])
    index.stored("b", [prompt[0], prompt[2], prompt[3]])  # missing block 1: only 1 leads
    assert index.match(prompt, ["a", "b", "c"], now=0.0) == {"a": 3, "b": 1, "c": 0}


def test_removed_and_cleared_follow_evictions():
    index = PrefixIndex()
    prompt = hash_prompt_blocks(list(range(48)), 16)
    index.stored("a", prompt)
    index.removed("a", [prompt[2]])
    assert index.match(prompt, ["a"], 0.0) == {"a": 2}
    index.removed("a", [prompt[0]])
    assert index.match(prompt, ["a"], 0.0) == {"a": 0}
    index.stored("a", prompt)
    index.cleared("a")
    assert index.match(prompt, ["a"], 0.0) == {"a": 0}


def test_cache_salt_separates_prefixes():
    tokens = list(range(32))
    index = PrefixIndex()
    index.stored("a", hash_prompt_blocks(tokens, 16, cache_salt="tenant-1"))
    assert index.match(hash_prompt_blocks(tokens, 16, cache_salt="tenant-1"), ["a"], 0.0) == {"a": 2}
    assert index.match(hash_prompt_blocks(tokens, 16, cache_salt="tenant-2"), ["a"], 0.0) == {"a": 0}
    assert index.match(hash_prompt_blocks(tokens, 16), ["a"], 0.0) == {"a": 0}


def test_predictions_expire_and_are_replaced_by_confirmation():
    index = PrefixIndex(prediction_ttl_s=5.0)
    prompt = hash_prompt_blocks(list(range(32)), 16)
    index.predict("a", prompt, now=100.0)
    assert index.match(prompt, ["a"], now=104.0) == {"a": 2}
    assert index.match(prompt, ["a"], now=106.0) == {"a": 0}
    index.predict("a", prompt, now=200.0)
    index.stored("a", prompt)
    assert index.match(prompt, ["a"], now=1000.0) == {"a": 2}  # confirmed: no expiry
    index.removed("a", prompt)
    assert index.match(prompt, ["a"], now=200.0) == {"a": 0}  # eviction drops the prediction too


def test_prediction_capacity_evicts_oldest():
    index = PrefixIndex(prediction_ttl_s=1e9, prediction_capacity=4)
    first = hash_prompt_blocks(list(range(32)), 16)
    second = hash_prompt_blocks(list(range(100, 164)), 16)
    index.predict("a", first, 0.0)
    index.predict("a", second, 0.0)  # 2 + 4 > 4: the first prompt's blocks go
    assert index.match(first, ["a"], 1.0) == {"a": 0}
    assert index.match(second, ["a"], 1.0) == {"a": 4}


def test_replace_is_a_snapshot_with_its_seq():
    index = PrefixIndex()
    index.stored("a", [1, 2, 3])
    index.replace("a", [7, 8], seq=42)
    assert index.confirmed_blocks("a") == {7, 8}
    assert index.seq("a") == 42
    assert index.sizes() == {"a": 2}
    index.forget("a")
    assert index.replica_ids() == [] and index.seq("a") == 0


def test_predictions_live_as_long_as_the_slowest_prefill_in_sight():
    """A replica reports a prompt's blocks once its prefill is done: on a fleet where that takes
    30 s, a prediction outlives the 10 s floor (2 x the wait), earlier ones included; a wait
    shorter than half the floor leaves the floor."""
    index = PrefixIndex(prediction_ttl_s=10.0)
    prompt = hash_prompt_blocks(list(range(32)), 16)
    index.predict("a", prompt, now=100.0)
    index.stretch(30.0)
    assert index.prediction_ttl_s == 60.0
    assert index.match(prompt, ["a"], now=150.0) == {"a": 2}  # still unconfirmed at 50 s: held
    assert index.match(prompt, ["a"], now=161.0) == {"a": 0}
    index.stretch(2.0)
    assert index.prediction_ttl_s == 10.0
    assert prediction_ttl(10.0, 30.0) == 60.0 and prediction_ttl(10.0, -1.0) == 10.0
