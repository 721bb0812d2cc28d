"""The Redis of an InferenceService's KV index and the URL the servers and routers get."""

from __future__ import annotations

import re

from kvscale.operator.children.redis import (
    build_redis_deployment,
    build_redis_secret,
    redis_url_env,
    service_redis_env,
)
from kvscale.operator.spec import RedisSource, parse_spec

BUNDLED = {"model": {"uri": "bundled://smollm2-135m-instruct"}}


def test_internal_redis_url_comes_from_the_generated_secret():
    spec = parse_spec(BUNDLED)
    env = service_redis_env("chat", "team", spec)
    assert env[0] == {"name": "KVSCALE_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
        "name": "chat-redis", "key": "password"}}}
    # Defined after the password, so Kubernetes expands $(KVSCALE_REDIS_PASSWORD) in it.
    assert env[1] == {"name": "KVSCALE_REDIS_URL",
                      "value": "redis://:$(KVSCALE_REDIS_PASSWORD)@chat-redis.team.svc:6379/0"}
    first, second = (build_redis_secret("chat", "team") for _ in range(2))
    assert first["stringData"]["password"] != second["stringData"]["password"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{40,}", first["stringData"]["password"])
    redis = build_redis_deployment("chat", "team", "redis:7")
    assert redis["spec"]["strategy"] == {"type": "Recreate"}  # never two indexes at once
    container = redis["spec"]["template"]["spec"]["containers"][0]
    # Redis gets the password's SHA-256, never the password (test_redis_password.py).
    assert "--requirepass" not in container["args"] and "#$(KVSCALE_REDIS_PASSWORD_SHA256)" in container["args"]


def test_a_router_without_an_index_gets_no_url():
    """The namespace-wide router with no Redis in its values: it routes by load and health."""
    assert redis_url_env(RedisSource(), None) == []
    assert redis_url_env(RedisSource(url="redis://r:6379/0"), None) == [
        {"name": "KVSCALE_REDIS_URL", "value": "redis://r:6379/0"}]
