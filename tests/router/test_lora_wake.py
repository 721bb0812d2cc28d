"""A request naming one of the service's LoRA adapters (`--lora-adapter-names`, rendered by the
operator from spec.adapters) is held at zero replicas and wakes them, as one for the served model;
an unknown name is still not held (router/hold_gate.py; docs/operator.md, "LoRA adapters")."""

from __future__ import annotations

import time

import httpx

from kvscale.router.config import RouterConfig
from kvscale.router.hold_gate import worth_holding


def test_an_adapter_of_the_service_is_held_only_while_no_replica_is_up() -> None:
    config = RouterConfig(served_model_names=["base"], lora_adapter_names=["sql"])
    assert worth_holding("sql", config, any_up=False)
    assert not worth_holding("sql", config, any_up=True)  # up without it: 404, not a wait
    assert not worth_holding("other", config, any_up=False)
    assert worth_holding("base", config, any_up=True) and worth_holding(None, config, any_up=True)


def test_at_zero_replicas_an_adapter_request_is_held(in_process_routers) -> None:
    # No tokenizer (models=[]) and so no served names: the unknown name's 404 is the test above.
    url = in_process_routers.start(RouterConfig(
        replicas=[], policy="round-robin", models=[], lora_adapter_names=["sql"], hold_timeout_s=0.3))
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["sql"]
    started = time.monotonic()
    held = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"}, timeout=10)
    assert held.status_code == 503 and "no replica became ready" in held.json()["error"]["message"]
    assert time.monotonic() - started >= 0.3
