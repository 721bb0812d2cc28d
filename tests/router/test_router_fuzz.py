"""The OpenAPI fuzz through the router: schemathesis generates valid and invalid
requests from the server's own /openapi.json (the router serves the same API) and sends them to a
router in front of a real replica, without and with an API key. No answer may be a 5xx, no
process may die, and the router's memory stays bounded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from openapi_fuzz import fuzz  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "sk-router-fuzz"
RSS_GROWTH_LIMIT_MIB = 200


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "api-key"])
def test_router_fuzz_has_no_server_errors(launcher, keyed: bool) -> None:
    key_args = ["--api-key", API_KEY] if keyed else []
    replica = launcher.replica(None, "fuzzed", extra=key_args)
    router = launcher.router([replica.url], None, policy="predicted-ttft", health_path="/health",
                             extra=[*key_args, *(["--replica-api-key", API_KEY] if keyed else [])])
    # The schema is behind the key like every route but /health and /metrics.
    key_header = {"Authorization": f"Bearer {API_KEY}"} if keyed else {}
    schema = schemathesis.openapi.from_url(f"{replica.url}/openapi.json", headers=key_header)
    rss_before = rss_mib(router.proc.pid)
    calls: dict[str, int] = {}
    # With a key: requests that carry it, and requests that do not (each must be a clean 401).
    header_sets = [{"Authorization": f"Bearer {API_KEY}"}, {}] if keyed else [{}]
    for result in schema.get_all_operations():
        operation = result.ok()
        for headers in header_sets:
            fuzz(operation, GenerationMode.POSITIVE, router.url, calls, headers, max_examples=6)
            if operation.method.upper() == "POST":
                fuzz(operation, GenerationMode.NEGATIVE, router.url, calls, headers, max_examples=6)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} <= set(calls)
    assert router.proc.poll() is None and replica.proc.poll() is None, "a process died"
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    assert rss_mib(router.proc.pid) - rss_before < RSS_GROWTH_LIMIT_MIB
