"""LoRA adapters in the router's decision: which replicas serve an adapter (heartbeat over
/v1/models), its base model's tokenizer, block hashes keyed by the adapter exactly as the engine
keys them, and the affinity term (resident, a slot free, none free) that breaks ties and places
an adapter's new prompts, spreading them once the replica holding it is busy."""

from __future__ import annotations

from typing import Any

import pytest

from kvscale.block_hash import hash_prompt_blocks
from kvscale.kv_index_schema import MAX_PUBLISHED_LORAS, Heartbeat
from kvscale.router.candidates import (
    LORA_FREE_SLOT,
    LORA_NO_SLOT,
    LORA_RESIDENT,
    Candidate,
    lora_affinity,
)
from kvscale.router.lora_routing import (
    Adapter,
    adapters_of,
    replica_affinity,
    request_adapter,
    serves,
)
from kvscale.router.predicted_ttft import lora_wait_s, predicted_ttft, predicted_ttft_policy
from kvscale.router.prefix_hashes import PrefixHasher
from kvscale.router.replicas import Replica
from kvscale.tokenization import completion_prompt_token_ids


def heartbeat(replica_id: str, model: str = "base", adapters: tuple[str, ...] = (), resident: tuple[str, ...] = (),
              running: tuple[str, ...] = (), max_loras: int = 2) -> Heartbeat:
    return Heartbeat(replica_id, model, f"http://{replica_id}", 16, 0, 0, 0, 100, 0.0,
                     lora_adapters=list(adapters), lora_resident=list(resident), lora_running=list(running),
                     max_loras=max_loras)


def replica(replica_id: str, models: set[str], adapters: dict[str, str] | None = None) -> Replica:
    return Replica(f"http://{replica_id}", replica_id, models=models, adapters=adapters or {}, healthy=True)


@pytest.fixture(scope="module")
def hasher() -> PrefixHasher:
    hasher = PrefixHasher([None])
    hasher.load_tokenizers()  # the bundled model's tokenizer
    return hasher


def test_affinity_orders_resident_then_a_free_slot_then_none() -> None:
    assert lora_affinity(None, [], ["a", "b"], 2) == LORA_RESIDENT  # a base request: nothing to load
    assert lora_affinity("sql", ["sql"], [], 2) == LORA_RESIDENT
    assert lora_affinity("sql", [], ["sql"], 2) == LORA_RESIDENT  # running: in the batch's slots
    assert lora_affinity("sql", ["a", "b"], ["a"], 2) == LORA_FREE_SLOT  # an idle adapter makes way
    assert lora_affinity("sql", ["a", "b"], ["a", "b"], 2) == LORA_NO_SLOT
    assert lora_affinity("sql", [], ["a", "b"], 0) == LORA_FREE_SLOT  # slots not published
    assert replica_affinity("sql", None) == LORA_FREE_SLOT  # no heartbeat: registered, slot assumed
    assert replica_affinity(None, heartbeat("r", running=("a", "b"))) == LORA_RESIDENT
    assert LORA_RESIDENT < LORA_FREE_SLOT < LORA_NO_SLOT


def test_the_heartbeat_carries_the_adapters_bounded() -> None:
    beat = heartbeat("r0", adapters=("sql", "chat"), resident=("sql",), running=("sql",), max_loras=4)
    back = Heartbeat.from_json("r0", beat.to_json(), 1.0)
    assert (back.lora_adapters, back.lora_resident, back.lora_running, back.max_loras) == (
        ["sql", "chat"], ["sql"], ["sql"], 4)
    many = heartbeat("r0", adapters=tuple(f"a{i}" for i in range(300)))
    assert len(Heartbeat.from_json("r0", many.to_json(), 1.0).lora_adapters) == MAX_PUBLISHED_LORAS
    old = Heartbeat.from_json("r0", '{"model": "base", "lora_adapters": "sql", "lora_resident": [1, "x"]}', 1.0)
    assert (old.lora_adapters, old.lora_resident, old.max_loras) == ([], ["x"], 0)


def test_the_publisher_reports_registered_resident_and_running_adapters() -> None:
    from kvscale.server.engine.kv_publisher import KVEventPublisher
    from kvscale.server.outputs import EngineStats

    publisher = KVEventPublisher("redis://unused", "r0", "base", "http://r0", 16)
    publisher._latest_stats = EngineStats(
        1, 0, 100, 4, 0, 16, 0, 0, 0, extra={"max_loras": 2.0}, running_lora_adapters=["sql"],
        lora_adapters=[f"a{i}" for i in range(300)], resident_lora_adapters=["sql", "a7"])
    beat = publisher.heartbeat()
    assert len(beat.lora_adapters) == MAX_PUBLISHED_LORAS and beat.lora_adapters[0] == "a0"
    assert (beat.lora_resident, beat.lora_running, beat.max_loras) == (["sql", "a7"], ["sql"], 2)


def test_the_heartbeat_says_which_replicas_serve_an_adapter_over_v1_models() -> None:
    r0 = replica("r0", {"base", "sql"}, {"sql": "base"})
    # Loaded at run time: in the heartbeat, not yet in the /v1/models read at the first check.
    assert serves(r0, heartbeat("r0", adapters=("sql", "chat")), "chat")
    # Unloaded at run time: /v1/models still lists it, the heartbeat no longer does.
    assert not serves(r0, heartbeat("r0", adapters=()), "sql")
    assert serves(r0, None, "sql") and not serves(r0, None, "chat")  # no heartbeat: /v1/models
    assert serves(r0, heartbeat("r0", max_loras=0), "sql")  # LoRA not published: /v1/models
    assert serves(r0, heartbeat("r0"), "base")  # the base model's name, whatever the adapters
    assert list(adapters_of(r0, None)) == ["sql"]


def test_an_adapters_base_is_its_parent_or_the_replicas_model_with_a_tokenizer() -> None:
    r0 = replica("r0", {"base", "sql"}, {"sql": "base"})
    r1 = replica("r1", {"base"})
    beats = {"r1": heartbeat("r1", model="base", adapters=("chat",))}
    assert request_adapter("sql", [r0], beats.get, {"base"}) == Adapter("sql", "base")
    assert request_adapter("chat", [r1], beats.get, {"base"}) == Adapter("chat", "base")
    assert request_adapter("base", [r0, r1], beats.get, {"base"}) is None  # a base model's name
    assert request_adapter(None, [r0], beats.get, {"base"}) is None
    # A parent the router has no tokenizer for: the replica's served name it has one for.
    r2 = replica("r2", {"Base-7B", "sql"}, {"sql": "meta/base"})
    assert request_adapter("sql", [r2], beats.get, {"Base-7B"}) == Adapter("sql", "Base-7B")
    assert request_adapter("sql", [r2], beats.get, set()) == Adapter("sql", "meta/base")


def test_adapter_prompts_hash_exactly_as_the_engine_keys_them(hasher: PrefixHasher) -> None:
    from kvscale.server.core.block_pool import BlockPool
    from kvscale.server.core.kv_cache_manager import KVCacheManager
    from kvscale.server.core.sequence import Request, Sequence
    from kvscale.server.outputs import RequestMetrics
    from kvscale.server.sampling_params import SamplingParams

    (name,) = hasher.tokenizers
    prompt = "The lighthouse keeper counted ships " * 12
    ids = completion_prompt_token_ids(hasher.tokenizers[name], prompt)

    def engine_hashes(lora_name: str | None, salt: str | None) -> list[int]:
        kv = KVCacheManager(BlockPool(64, 16, True), True)
        request = Request("r", None, ids, SamplingParams(max_tokens=1), salt, RequestMetrics(0.0), 1,
                          lora_name=lora_name)
        seq = Sequence(request, 0, list(ids), len(ids))
        kv._ensure_hashes(seq, len(ids) // 16)
        return list(seq.block_hashes)

    body = {"model": "sql", "prompt": prompt, "cache_salt": "s"}
    routed = hasher.prompt_block_hashes("completions", body, name, lora_name="sql")
    assert routed.hashes == engine_hashes("sql", "s") and len(routed.hashes) == len(ids) // 16
    base = hasher.prompt_block_hashes("completions", {**body, "model": name}, name)
    assert base.hashes == engine_hashes(None, "s") == hash_prompt_blocks(ids, 16, cache_salt="s")
    assert not set(base.hashes) & set(routed.hashes)  # never shared with the base model


def test_chat_turns_of_an_adapter_hash_alike_with_the_token_cache(hasher: PrefixHasher) -> None:
    plain = PrefixHasher([None], chat_cache_tokens=0)
    plain.tokenizers = hasher.tokenizers
    (name,) = hasher.tokenizers
    messages = [{"role": "user", "content": "Summarise: " + "kilo lima mike " * 30}]
    for turn in range(3):
        body = {"model": "sql", "messages": messages}
        cached = hasher.prompt_block_hashes("chat", body, name, lora_name="sql")
        assert cached == plain.prompt_block_hashes("chat", body, name, chat_cache=False, lora_name="sql")
        # The same history under the base model (cached just before) hashes apart, and back.
        assert hasher.prompt_block_hashes("chat", body, name).hashes[0] != cached.hashes[0]
        messages = [*messages, {"role": "assistant", "content": f"answer {turn}"},
                    {"role": "user", "content": f"more {turn}?"}]


def idle(replica_id: str, affinity: int = LORA_RESIDENT, **kwargs: object) -> Candidate:
    fields: dict = {"prefill_tokens_per_s": 1000.0, "decode_step_s": 0.02, "lora_affinity": affinity}
    fields.update(kwargs)
    return Candidate(replica_id, 0, **fields)


def test_a_new_adapter_prompt_goes_where_the_adapter_is_readiest() -> None:
    for key in range(20):  # whatever the rendezvous hash prefers
        cands = [idle("none", LORA_NO_SLOT), idle("free", LORA_FREE_SLOT), idle("resident", LORA_RESIDENT)]
        decision = predicted_ttft_policy(cands, 64, 16, key)
        assert decision.ranked == ["resident", "free", "none"] and decision.reason == "lora"
        decision = predicted_ttft_policy(cands[:2], 64, 16, key)
        assert decision.ranked == ["free", "none"]


def test_a_hot_adapter_spreads_when_its_replica_is_busy() -> None:
    resident = idle("resident", LORA_RESIDENT, queued_prefill_tokens=10)
    free = idle("free", LORA_FREE_SLOT)
    # Busy, within the tolerated error: the adapter stays where it is loaded.
    assert predicted_ttft_policy([free, resident], 64, 16, "k").ranked[0] == "resident"
    # Truly overloaded (the spill rule): the next request loads the adapter elsewhere.
    busy = idle("resident", LORA_RESIDENT, queued_prefill_tokens=4000)
    assert predicted_ttft_policy([free, busy], 64, 16, "k").ranked[0] == "free"


def test_every_slot_taken_costs_the_soonest_end_of_a_running_request() -> None:
    waiting = idle("full", LORA_NO_SLOT, num_decoding=2, decode_left_s=(0.5, 0.3))
    assert lora_wait_s(waiting) == 0.3
    assert lora_wait_s(idle("full", LORA_NO_SLOT)) == 0.02  # nothing known: one decode step
    assert lora_wait_s(idle("free", LORA_FREE_SLOT, decode_left_s=(0.5,))) == 0.0
    assert predicted_ttft(waiting, 64, 16) == pytest.approx(predicted_ttft(
        idle("x", LORA_FREE_SLOT, num_decoding=2, decode_left_s=(0.5, 0.3)), 64, 16) + 0.3)


def test_a_held_adapter_prefix_keeps_its_holder_and_base_requests_are_unaffected() -> None:
    holder = idle("holder", LORA_FREE_SLOT, matched_blocks=4)
    resident = idle("resident", LORA_RESIDENT)
    assert predicted_ttft_policy([resident, holder], 80, 16, "k").ranked[0] == "holder"
    # Base requests: every replica as ready, the decision is the one without adapters.
    base = [idle("a", queued_prefill_tokens=100), idle("b"), idle("c", matched_blocks=2)]
    for key in range(10):
        decision = predicted_ttft_policy(base, 64, 16, key)
        assert decision.reason != "lora" and decision.ranked[0] == "c"


def test_the_router_offers_an_adapters_requests_to_the_replicas_serving_it_else_404() -> None:
    import json
    import types

    from kvscale.router import lora_routing
    from kvscale.router.app import Router
    from kvscale.router.config import RouterConfig

    router = Router(RouterConfig(replicas=["http://127.0.0.1:1", "http://127.0.0.1:2"]))
    r0, r1 = router.replicas.replicas.values()
    for r in (r0, r1):
        r.healthy, r.models, r.adapters = True, {"base", "sql"}, {"sql": "base"}
    beats = {r0.replica_id: heartbeat(r0.replica_id, adapters=("sql",)),
             r1.replica_id: heartbeat(r1.replica_id, adapters=("sql", "chat"), resident=("chat",))}
    feed: Any = types.SimpleNamespace(healthy=True, heartbeats=beats, healthy_since=None)  # a read feed
    router.heartbeats.feed = feed
    assert router._candidates("chat") == [r1]  # loaded at run time on r1 only (its heartbeat)
    assert router._candidates("base") == [r0, r1]
    assert lora_routing.served_names(r1, beats[r1.replica_id]) == {"base", "sql", "chat"}  # its /v1/models
    assert lora_routing.served_names(r0, heartbeat(r0.replica_id)) == {"base"}  # sql unloaded at run time
    missing = router._candidates("sql-v2")
    assert not isinstance(missing, list) and missing.status_code == 404
    assert json.loads(bytes(missing.body))["error"]["code"] == "model_not_found"
    # Registered on both, resident on neither: as ready; resident on r1 once r1 reports it.
    beats[r1.replica_id] = heartbeat(r1.replica_id, adapters=("sql",), resident=("sql",))
    adapter = request_adapter("sql", [r0, r1], router.heartbeats.get, {"base"})
    assert adapter == Adapter("sql", "base")
    decision = router.decider.decide([r0, r1], [], "k", None, 40, 16, adapter.name)
    assert decision.ranked[0] == r1.replica_id and decision.reason == "lora"
    assert router.decider.decide([r0, r1], [], "k", None, 40, 16).reason != "lora"  # the base model


def test_engine_stats_name_the_registered_and_the_resident_adapters() -> None:
    import types

    from kvscale.server.core.block_pool import BlockPool
    from kvscale.server.core.kv_cache_manager import KVCacheManager
    from kvscale.server.core.scheduler import Scheduler
    from kvscale.server.engine.engine_stats import engine_stats

    kv = KVCacheManager(BlockPool(16, 4, True), True)
    scheduler = Scheduler(kv, 4, 64)
    manager: Any = types.SimpleNamespace(paths={"sql": "/a/sql", "chat": "/a/chat"}, resident={"sql": object()})
    stats = engine_stats(scheduler, kv, num_generated_tokens=0, num_prompt_tokens_computed=0, last_step_s=0.0,
                         lora=manager)
    assert (stats.lora_adapters, stats.resident_lora_adapters) == (["chat", "sql"], ["sql"])
    plain = engine_stats(scheduler, kv, num_generated_tokens=0, num_prompt_tokens_computed=0, last_step_s=0.0)
    assert (plain.lora_adapters, plain.resident_lora_adapters) == ([], [])
