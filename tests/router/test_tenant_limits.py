"""Tenants' decisions without the router: the tenants file (router/tenants.py), the rate-limit
arithmetic and headers (router/rate_limits.py), and the admission and correction scripts
(kvscale/tenant_limits_schema.py) run on a real redis-server."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import time
import uuid
from pathlib import Path

import pytest
import redis

from kvscale.router import rate_limits as rules
from kvscale.router.cli_router import add_arguments, config_from_args
from kvscale.router.tenants import (
    MAX_FILE_BYTES,
    MAX_TENANTS,
    Tenant,
    TenantFile,
    TenantFileError,
    load_tenants,
    parse_tenants,
)
from kvscale.tenant_limits_schema import (
    WINDOW_S,
    admit_args,
    admit_script,
    correct_args,
    correct_script,
    window_key,
)

GOOD = f"""
- name: team-a
  api_key: sk-team-a
  requests_per_minute: 3
  tokens_per_minute: 1000
  weight: 2
  priority: -1
- name: batch.jobs_1
  api_key_sha256: {hashlib.sha256(b"sk-batch").hexdigest()}
"""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# -- the tenants file --------------------------------------------------------------------------
def test_a_tenants_file_gives_each_tenant_its_key_limits_and_defaults() -> None:
    table = parse_tenants(GOOD)
    a, batch = table.tenants
    assert a == Tenant("team-a", digest("sk-team-a"), 3, 1000, 2.0, -1)
    assert batch == Tenant("batch.jobs_1", digest("sk-batch"), None, None, 1.0, 0)
    assert table.match(digest("sk-team-a")) is a and table.match(digest("sk-batch")) is batch
    assert table.match(digest("sk-team-b")) is None and table.match(digest("")) is None
    assert a.limited and not batch.limited and table.limited


@pytest.mark.parametrize(("text", "says"), [
    ("team-a: {}", "non-empty YAML list"),
    ("[]", "non-empty YAML list"),
    ("- [", "not valid YAML"),
    ("- just-a-string", "a tenant is a mapping"),
    ("- {name: a, api_key: k, rpm: 3}", "unknown field(s) rpm"),
    ("- {name: A_b, api_key: k}", "name must be"),
    ("- {name: a-, api_key: k}", "name must be"),
    ("- {name: a}", "exactly one of api_key, api_key_sha256, api_key_env"),
    ("- {name: a, api_key: k, api_key_env: KEY_A}", "exactly one of"),
    ("- {name: a, api_key_env: 'KEY A'}", "api_key_env must name an environment variable"),
    ("- {name: a, api_key_env: KVSCALE_TEST_UNSET_KEY}", "KVSCALE_TEST_UNSET_KEY (api_key_env) is not set"),
    ("- {name: a, api_key_env: EMPTY_KEY}", "EMPTY_KEY (api_key_env) is not set or empty"),
    ("- {name: a, api_key: k, api_key_sha256: " + "0" * 64 + "}", "exactly one of"),
    ("- {name: a, api_key: ''}", "api_key must be a non-empty string"),
    ("- {name: a, api_key: ' k'}", "api_key must be a non-empty string"),
    ("- {name: a, api_key_sha256: abc}", "64 hexadecimal digits"),
    ("- {name: a, api_key_sha256: " + hashlib.sha256(b"").hexdigest() + "}", "the key is empty"),
    ("- {name: a, api_key: k, requests_per_minute: 0}", "requests_per_minute must be a positive"),
    ("- {name: a, api_key: k, tokens_per_minute: true}", "tokens_per_minute must be a positive"),
    ("- {name: a, api_key: k, tokens_per_minute: 1.5}", "tokens_per_minute must be a positive"),
    ("- {name: a, api_key: k, weight: 0}", "weight must be a positive number"),
    ("- {name: a, api_key: k, priority: high}", "priority must be an integer"),
    ("- {name: a, api_key: k}\n- {name: a, api_key: j}", "the name 'a' is given twice"),
    ("- {name: a, api_key: k}\n- {name: b, api_key: k}", "'a' and 'b' have the same key"),
])
def test_a_bad_tenants_file_says_which_entry_and_why(text: str, says: str) -> None:
    with pytest.raises(TenantFileError) as caught:
        parse_tenants(text, "tenants.yaml", {"EMPTY_KEY": ""})
    assert says in str(caught.value) and "tenants.yaml" in str(caught.value)


def test_a_key_from_the_environment_is_held_as_its_digest() -> None:
    """On Kubernetes the file is a ConfigMap naming variables the pod sets from Secrets
    (docs/operator.md, "Tenants"): the key is read from the router's environment."""
    text = "- {name: a, api_key_env: KVSCALE_TENANT_KEY_0}\n- {name: b, api_key_env: KEY_B}"
    table = parse_tenants(text, environ={"KVSCALE_TENANT_KEY_0": "sk-a\n", "KEY_B": "sk-b"})
    assert [t.key_sha256 for t in table.tenants] == [digest("sk-a"), digest("sk-b")]
    with pytest.raises(TenantFileError, match="have the same key"):
        parse_tenants(text, environ={"KVSCALE_TENANT_KEY_0": "sk-a", "KEY_B": "sk-a"})


def test_the_tenants_file_is_bounded_in_bytes_and_entries(tmp_path: Path) -> None:
    many = "".join(f"- {{name: t{i}, api_key: k{i}}}\n" for i in range(MAX_TENANTS + 1))
    with pytest.raises(TenantFileError, match=f"at most {MAX_TENANTS}"):
        parse_tenants(many)
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(TenantFileError, match="over"):
        load_tenants(big)
    with pytest.raises(TenantFileError, match="cannot read"):
        load_tenants(tmp_path / "missing.yaml")


def _replace(path: Path, text: str) -> None:
    """As an editor or a mounted ConfigMap does: a new file renamed over the old one."""
    new = path.with_suffix(".new")
    new.write_text(text)
    os.replace(new, path)


def test_the_file_is_reloaded_on_change_and_a_bad_edit_keeps_the_table(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(GOOD)
    now = [0.0]
    tenants = TenantFile(path, poll_s=1.0, clock=lambda: now[0])
    seen: list[list[str]] = []
    tenants.on_reload.append(lambda table: seen.append(table.names))
    _replace(path, GOOD + "- {name: team-b, api_key: sk-team-b}\n")
    assert tenants.current().match(digest("sk-team-b")) is None  # not polled within poll_s
    now[0] = 1.0
    assert tenants.current().match(digest("sk-team-b")).name == "team-b"  # type: ignore[union-attr]
    assert seen == [["team-a", "batch.jobs_1", "team-b"]] and tenants.reloads == 1
    with caplog.at_level(logging.ERROR, logger="kvscale.router"):
        _replace(path, "- {name: team-b}\n")
        now[0] = 2.0
        table = tenants.current()
    assert table.match(digest("sk-team-b")) is not None and tenants.reloads == 1
    assert "keeping the 3 tenants in force" in caplog.text and "exactly one of" in caplog.text


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--replicas", "http://127.0.0.1:1", *argv])


def test_kvscale_router_checks_the_tenants_file_at_start(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_API_KEY", raising=False)
    monkeypatch.delenv("KVSCALE_REDIS_URL", raising=False)
    path = tmp_path / "tenants.yaml"
    path.write_text("- {name: a, api_key: k}\n")
    config = config_from_args(_args("--tenants", str(path)))
    assert config.tenants is not None and config.tenants.table.names == ["a"]
    assert config_from_args(_args()).tenants is None  # without it: as before
    with pytest.raises(SystemExit, match="not both"):
        config_from_args(_args("--tenants", str(path), "--api-key", "k"))
    path.write_text(GOOD)
    with pytest.raises(SystemExit, match="give --redis"):
        config_from_args(_args("--tenants", str(path)))
    path.write_text("- {name: a, api_key: k, weight: -1}\n")
    with pytest.raises(SystemExit, match="--tenants: .*weight must be a positive number"):
        config_from_args(_args("--tenants", str(path), "--redis", "redis://127.0.0.1:1"))


# -- what a request costs, what the client is told ----------------------------------------------
def test_a_request_reserves_its_prompt_and_the_completion_it_asks_for() -> None:
    assert rules.request_tokens("chat", {"max_completion_tokens": 50, "max_tokens": 9}, 20, 999) == 70
    assert rules.request_tokens("chat", {"max_tokens": 9, "n": 3}, 20, 999) == 47
    assert rules.request_tokens("chat", {}, 20, 999) == 20  # charged at its end
    assert rules.request_tokens("completions", {}, 20, 999) == 36  # the servers' default 16
    assert rules.request_tokens("completions", {"max_tokens": None}, 20, 999) == 20
    assert rules.request_tokens("completions", {"max_tokens": "many", "n": True}, 20, 999) == 20
    assert rules.request_tokens("completions", {"max_tokens": 4, "n": 10**9}, 0, 401) == 101 + 4 * 128


def test_the_rate_limit_headers_say_what_is_left_of_each_limit() -> None:
    both = Tenant("a", b"", 3, 100)
    counts = rules.WindowCounts("", 2, 130, 1500, 7)
    assert rules.headers(both, counts) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "1.500s", "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1.500s"}
    assert set(rules.headers(Tenant("b", b"", None, 100), counts)) == {
        "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}
    assert [rules.retry_after_s(ms) for ms in (0, 1, 1000, 1001, 59_999)] == [1, 1, 1, 2, 60]


def test_the_refusal_says_which_limit_and_when_to_retry() -> None:
    tenant = Tenant("a", b"", 3, 100)
    by_requests = rules.refusal_message(tenant, rules.WindowCounts("requests", 3, 0, 4200, 1), 1)
    assert "requests per minute: limit 3, used 3" in by_requests and "Retry in 5 s" in by_requests
    by_tokens = rules.refusal_message(tenant, rules.WindowCounts("tokens", 1, 90, 4200, 1), 20)
    assert "limit 100, used 90, requested 20" in by_tokens and not rules.too_large(tenant, 20)
    alone = rules.refusal_message(tenant, rules.WindowCounts("tokens", 0, 0, 4200, 1), 101)
    assert rules.too_large(tenant, 101) and "Request too large" in alone and "Retry" not in alone


def test_the_usage_is_read_from_an_answers_tail() -> None:
    usage = b'"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,' \
            b'"prompt_tokens_details":{"cached_tokens":0}}'
    assert rules.usage_tokens(b'{"id":"c","choices":[{"text":"x"}],' + usage + b"}") == 10
    stream = (b'data: {"choices":[{"text":"x"}],"usage":null}\n\n'
              b'data: {"choices":[],' + usage + b"}\n\ndata: [DONE]\n\n")
    assert rules.usage_tokens(stream) == 10
    assert rules.usage_tokens(b'data: {"choices":[{"text":"x"}],"usage":null}\n\n') is None
    assert rules.usage_tokens(b'{"error": {"message": "bad"}}') is None


def test_a_reservation_is_settled_by_the_usage_or_given_back_on_an_error() -> None:
    assert rules.settlement(50, 10, 200) == -40
    assert rules.settlement(50, 80, 200) == 30
    assert rules.settlement(50, None, 200) == 0  # answered without usage: the reservation stands
    assert rules.settlement(50, None, 400) == -50
    assert rules.settlement(50, None, 502) == -50
    assert rules.settlement(50, None, 499) == 0  # the client left while it was served


# -- the scripts, on a real Redis ---------------------------------------------------------------
@pytest.fixture
def client(session_redis) -> redis.Redis:
    return redis.Redis.from_url(session_redis.url)


def clear_of_window_end(client: redis.Redis, margin_s: float = 3.0) -> None:
    """Wait out the end of the current window when it is near: a test counting N requests in
    one window must not see it roll over."""
    seconds, micros = client.time()
    left = WINDOW_S - (seconds + micros / 1e6) % WINDOW_S
    if left < margin_s:
        time.sleep(left + 0.05)


def test_the_n_plus_first_request_of_a_window_is_refused(client: redis.Redis) -> None:
    admit = admit_script(client)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    clear_of_window_end(client)
    answers = [rules.WindowCounts.from_script(admit(keys=[], args=admit_args(tenant, 3, None, 5)))
               for _ in range(4)]
    assert [(a.over, a.requests, a.tokens) for a in answers] == [
        ("", 1, 5), ("", 2, 10), ("", 3, 15), ("requests", 3, 15)]
    window = answers[0].window
    assert {a.window for a in answers} == {window} and 0 < answers[-1].reset_ms <= WINDOW_S * 1000
    assert client.get(window_key(tenant, window, "requests")) == b"3"
    assert 0 < client.pttl(window_key(tenant, window, "tokens")) <= WINDOW_S * 1000 + 1000


def test_tokens_are_limited_and_corrected_in_the_window_they_were_reserved_in(
        client: redis.Redis) -> None:
    admit, correct = admit_script(client), correct_script(client)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    clear_of_window_end(client)
    first = rules.WindowCounts.from_script(admit(keys=[], args=admit_args(tenant, None, 100, 60)))
    over = rules.WindowCounts.from_script(admit(keys=[], args=admit_args(tenant, None, 100, 41)))
    assert (first.over, over.over, over.tokens, over.requests) == ("", "tokens", 60, 1)
    assert correct(keys=[], args=correct_args(tenant, first.window, -50)) == 10
    again = rules.WindowCounts.from_script(admit(keys=[], args=admit_args(tenant, None, 100, 41)))
    assert (again.over, again.tokens, again.requests) == ("", 51, 2)
    # A window that has gone is left alone, never created again.
    assert correct(keys=[], args=correct_args(tenant, first.window - 1, 5)) is None
    assert not client.exists(window_key(tenant, first.window - 1, "tokens"))


def test_the_limiter_fails_open_while_redis_is_down_and_checks_again_after(redis_server) -> None:
    from kvscale.router.tenant_limiter import RETRY_AFTER_FAILURE_S, TenantLimiter

    unchecked: list[int] = []
    tenant = Tenant(f"t-{uuid.uuid4().hex[:8]}", b"", 1000, None)
    clear_of_window_end(redis.Redis.from_url(redis_server.url))

    async def scenario() -> None:
        # A killed Redis refuses at once; 2 s (not the router's 50 ms) keeps a loaded host's slow
        # first answer after the restart from reading as another outage.
        limiter = TenantLimiter(redis_server.url, 2.0, lambda: unchecked.append(1))
        try:
            assert (await limiter.admit(tenant, 1)).requests == 1  # type: ignore[union-attr]
            redis_server.kill()
            assert await limiter.admit(tenant, 1) is None and limiter.down
            assert len(unchecked) == 1
            quiet_until = limiter._quiet_until
            assert await limiter.admit(tenant, 1) is None and len(unchecked) == 2
            # Left alone: a try would have failed again and moved the quiet window on.
            assert limiter._quiet_until == quiet_until
            redis_server.start()  # empty: what was counted before the outage is gone with it
            await asyncio.sleep(RETRY_AFTER_FAILURE_S)
            counts = await limiter.admit(tenant, 1)
            assert counts is not None and counts.requests == 1 and not limiter.down
        finally:
            await limiter.close()

    asyncio.run(scenario())


def test_a_request_routed_twice_is_admitted_once(session_redis) -> None:
    """A held request whose replica went away is routed again (router/app.py): one count."""
    from starlette.requests import Request

    from kvscale.router.metrics import RouterMetrics
    from kvscale.router.tenancy import Grant, Tenancy
    from kvscale.router.tenants import SCOPE_KEY

    tenant = Tenant(f"t-{uuid.uuid4().hex[:8]}", b"", 5, None)
    request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [], SCOPE_KEY: tenant})
    client = redis.Redis.from_url(session_redis.url)
    clear_of_window_end(client)

    async def twice() -> tuple[Grant | object, Grant | object]:
        tenancy = Tenancy(None, None, session_redis.url, 2.0, RouterMetrics())
        try:
            first = await tenancy.admit(request, "completions", {}, 3, 10)
            return first, await tenancy.admit(request, "completions", {}, 3, 10)
        finally:
            await tenancy.close()

    first, second = asyncio.run(twice())
    assert isinstance(first, Grant) and second is first
    assert first.headers["x-ratelimit-remaining-requests"] == "4"
    window = int(client.time()[0]) // WINDOW_S
    assert client.get(window_key(tenant.name, window, "requests")) == b"1"
