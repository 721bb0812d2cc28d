"""A tenant's priority sent to replicas that run --scheduling-policy priority (docs/router.md,
"Priority on the replicas"): the pure decision (router/engine_priority.py) and the body a
tenant's request is forwarded with (router/tenancy.py), without a server; and the tokens its
answer reports, counted to the tenant."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from kvscale.router.cli_router import add_arguments, config_from_args
from kvscale.router.engine_priority import forwarded_priority, with_priority
from kvscale.router.metrics import RouterMetrics
from kvscale.router.tenancy import Grant, Tenancy
from kvscale.router.tenants import SCOPE_KEY, Tenant


def test_the_tenants_priority_is_sent_and_a_request_may_only_lower_its_urgency() -> None:
    assert forwarded_priority(0, {}) is None  # nothing to say: the engine's default 0
    assert forwarded_priority(5, {}) == 5
    assert forwarded_priority(5, {"priority": None}) == 5  # null is absent to the server too
    assert forwarded_priority(-2, {}) == -2
    assert forwarded_priority(5, {"priority": 9}) is None  # less urgent: as the client wrote it
    assert forwarded_priority(5, {"priority": 5}) is None
    assert forwarded_priority(5, {"priority": 0}) == 5  # more urgent than its tenant: not taken
    assert forwarded_priority(0, {"priority": -100}) == 0
    # What the engine refuses stays for its 400 to name the field.
    for bad in ("1", 1.5, True, 2**31 + 1):
        assert forwarded_priority(5, {"priority": bad}) is None


def test_the_body_keeps_every_other_field() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "priority": 0, "stream": True}
    assert json.loads(with_priority(body, 7)) == {**body, "priority": 7}


def admit(policy: str, tenant: Tenant, body: dict[str, Any],
          metrics: RouterMetrics | None = None) -> Grant:
    tenancy = Tenancy(None, None, None, 0.05, metrics or RouterMetrics(), scheduling_policy=policy)
    request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [], SCOPE_KEY: tenant})
    grant = asyncio.run(tenancy.admit(request, "completions", body, 3, 40))
    assert isinstance(grant, Grant)
    return grant


def test_a_tenants_request_is_forwarded_with_its_priority_under_the_priority_policy_only() -> None:
    batch = Tenant("batch", b"k" * 32, priority=10)
    body = {"model": "m", "prompt": "hi", "priority": -1}
    grant = admit("priority", batch, body)
    assert grant.tenant == "batch" and grant.body is not None
    assert json.loads(grant.body) == {**body, "priority": 10}
    assert admit("fcfs", batch, body).body is None  # the replicas would refuse it: left as is
    assert admit("priority", Tenant("interactive", b"i" * 32), {"model": "m"}).body is None


def test_kvscale_router_takes_the_replicas_scheduling_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_REDIS_URL", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--replicas", "http://127.0.0.1:1"]
    assert config_from_args(parser.parse_args(base)).scheduling_policy == "fcfs"
    routed = parser.parse_args([*base, "--scheduling-policy", "priority"])
    assert config_from_args(routed).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--scheduling-policy", "lifo"])


def test_a_tenants_answer_counts_the_tokens_its_usage_reports() -> None:
    metrics = RouterMetrics()
    grant = admit("fcfs", Tenant("team-a", b"a" * 32), {"model": "m"}, metrics)
    assert grant.on_done is not None
    grant.on_done(200, b'"usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}}')
    grant.on_done(200, b"data: [DONE]")  # a stream without include_usage: nothing to count
    sample = metrics.registry.get_sample_value
    assert sample("kvscale_router_tenant_tokens_total", {"tenant": "team-a"}) == 42
