"""A request naming one of the service's LoRA adapters (`--lora-adapter-names`, rendered by the
operator from spec.adapters) is held at zero replicas and wakes them, as one for the served model;
an unknown name is still not held (router/hold_gate.py; docs/operator.md, "LoRA adapters")."""

from __future__ import annotations

import time

import httpx

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.config import RouterConfig
from kvscale.router.hold_gate import can_take, worth_holding
from kvscale.router.replicas import Replica


def test_an_adapter_of_the_service_is_held_only_while_no_replica_is_up() -> None:
    config = RouterConfig(served_model_names=["base"], lora_adapter_names=["sql"])
    assert worth_holding("sql", config, any_up=False)
    assert not worth_holding("sql", config, any_up=True)  # up without it: 404, not a wait
    assert not worth_holding("other", config, any_up=False)
    assert worth_holding("base", config, any_up=True) and worth_holding(None, config, any_up=True)
    # One loaded at run time through the fleet's routers (their record) is held as one given at start.
    assert worth_holding("chat", config, any_up=False, runtime_adapters={"chat": "/a/chat"})
    assert not worth_holding("chat", config, any_up=True, runtime_adapters={"chat": "/a/chat"})


def test_a_held_request_for_an_adapter_is_released_once_routing_will_find_it() -> None:
    # Loaded at run time onto the replica (its /v1/models answered so), its heartbeat not yet saying so:
    # routing reads the heartbeat, so releasing the request now would answer it 404.
    replica = Replica(url="http://r0", replica_id="r0", models={"base", "sql"}, adapters={"sql": "base"},
                      healthy=True)
    beat = Heartbeat("r0", "base", "http://r0", 16, 0, 0, 0, 100, time.time(), max_loras=2, lora_adapters=[])
    def routable(r: Replica) -> bool:
        return r.healthy
    assert not can_take([replica], "sql", {"r0": beat}.get, routable)
    assert can_take([replica], "base", {"r0": beat}.get, routable) and can_take([replica], None, {}.get, routable)
    beat.lora_adapters = ["sql"]
    assert can_take([replica], "sql", {"r0": beat}.get, routable)
    assert can_take([replica], "sql", {}.get, routable)  # no heartbeat: its /v1/models decides
    replica.healthy = False
    assert not can_take([replica], None, {}.get, routable)


def test_at_zero_replicas_an_adapter_request_is_held(in_process_routers) -> None:
    # No tokenizer (models=[]) and so no served names: the unknown name's 404 is the test above.
    url = in_process_routers.start(RouterConfig(
        replicas=[], policy="round-robin", models=[], lora_adapter_names=["sql"], hold_timeout_s=0.3))
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["sql"]
    started = time.monotonic()
    held = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"}, timeout=10)
    assert held.status_code == 503 and "no replica became ready" in held.json()["error"]["message"]
    assert time.monotonic() - started >= 0.3
