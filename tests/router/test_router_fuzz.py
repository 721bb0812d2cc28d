"""The OpenAPI fuzz through the router (issue 20): schemathesis generates valid and invalid
requests from the server's own /openapi.json (the router serves the same API) and sends them to a
router in front of a real replica, without and with an API key. No answer may be a 5xx, no
process may die, and the router's memory stays bounded.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

API_KEY = "sk-router-fuzz"
# What the router serves itself or forwards: their errors carry the OpenAI error JSON.
API_PATHS = ("/v1/", "/tokenize", "/detokenize")
RSS_GROWTH_LIMIT_MIB = 200


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def cheap(case) -> None:
    """Keep generation cheap on a shared CPU: validation and routing are what is under test."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
            body[key] = 4
    if ("prompt" in body or "messages" in body) and body.get("max_tokens") is None and body.get(
            "max_completion_tokens") is None:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]


def fuzz(operation, mode: GenerationMode, base_url: str, headers: dict[str, str],
         calls: dict[str, int]) -> None:
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(max_examples=6, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(case) -> None:
        cheap(case)
        response = case.call(base_url=base_url, headers=headers, timeout=120)
        calls[operation.label] = calls.get(operation.label, 0) + 1
        assert response.status_code < 500, (
            f"{operation.label} {case.body!r} -> {response.status_code} {response.text}")
        if response.status_code >= 400 and operation.path.startswith(API_PATHS):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "api-key"])
def test_router_fuzz_has_no_server_errors(launcher, keyed: bool) -> None:
    key_args = ["--api-key", API_KEY] if keyed else []
    replica = launcher.replica(None, "fuzzed", extra=key_args)
    router = launcher.router([replica.url], None, policy="predicted-ttft", health_path="/health",
                             extra=[*key_args, *(["--replica-api-key", API_KEY] if keyed else [])])
    schema = schemathesis.openapi.from_url(f"{replica.url}/openapi.json")
    rss_before = rss_mib(router.proc.pid)
    calls: dict[str, int] = {}
    # With a key: requests that carry it, and requests that do not (each must be a clean 401).
    header_sets = [{"Authorization": f"Bearer {API_KEY}"}, {}] if keyed else [{}]
    for result in schema.get_all_operations():
        operation = result.ok()
        for headers in header_sets:
            fuzz(operation, GenerationMode.POSITIVE, router.url, headers, calls)
            if operation.method.upper() == "POST":
                fuzz(operation, GenerationMode.NEGATIVE, router.url, headers, calls)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} <= set(calls)
    assert router.proc.poll() is None and replica.proc.poll() is None, "a process died"
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    assert rss_mib(router.proc.pid) - rss_before < RSS_GROWTH_LIMIT_MIB
