"""Adapters loaded at run time through the router reach the replicas that join later or come back
(router/lora_replay.py; docs/router.md, "Loading adapters at run time"): the record (in Redis with
--redis, shared by the fleet's routers), what a replica lacks, a failed load counted and retried,
and requests naming the adapter only on the replicas that have it. Replicas are loopback HTTP
servers that keep their adapters as `kvscale serve` does; routers are served in this process."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis

from kvscale.kv_index_schema import (
    MAX_ADAPTER_NAME_CHARS,
    MAX_ADAPTER_PATH_CHARS,
    MAX_RUNTIME_ADAPTERS,
    RUNTIME_ADAPTERS_KEY,
    runtime_adapters,
)
from kvscale.processes import free_port
from kvscale.router.config import RouterConfig
from kvscale.router.lora_replay import missing_loads, update_refusal

KEY = "router-key"
LOAD, UNLOAD = "load_lora_adapter", "unload_lora_adapter"


def test_each_replica_lacks_the_recorded_adapters_it_does_not_hold() -> None:
    record = {"sql": "/a/sql", "chat": "/a/chat"}
    held = {"r0": ["sql", "chat", "other"], "r1": ["sql"], "r2": []}
    assert missing_loads(record, held) == {"r1": ["chat"], "r2": ["chat", "sql"]}
    assert missing_loads({}, held) == {}


def test_what_a_client_sends_is_bounded_before_any_replica_sees_it() -> None:
    assert update_refusal(LOAD, {"lora_name": "sql", "lora_path": "/a"}, {}) is None
    assert update_refusal(UNLOAD, {"lora_name": "sql"}, {}) is None
    long_name = {"lora_name": "n" * (MAX_ADAPTER_NAME_CHARS + 1), "lora_path": "/a"}
    assert update_refusal(LOAD, long_name, {})[1] == "lora_name"  # type: ignore[index]
    assert update_refusal(UNLOAD, {"lora_name": ""}, {})[1] == "lora_name"  # type: ignore[index]
    long_path = {"lora_name": "sql", "lora_path": "/" * (MAX_ADAPTER_PATH_CHARS + 1)}
    assert update_refusal(LOAD, long_path, {})[1] == "lora_path"  # type: ignore[index]
    assert update_refusal(LOAD, {"lora_name": "sql", "lora_path": 7}, {})[1] == "lora_path"  # type: ignore[index]
    full = {f"a{i}": "/a" for i in range(MAX_RUNTIME_ADAPTERS)}
    why = update_refusal(LOAD, {"lora_name": "new", "lora_path": "/a"}, full)
    assert why is not None and "unload one first" in why[0]
    assert update_refusal(LOAD, {"lora_name": "a7", "lora_path": "/b"}, full) is None  # a reload of one held


def test_the_record_read_from_redis_is_bounded() -> None:
    raw = {b"sql": b"/a/sql", b"n" * (MAX_ADAPTER_NAME_CHARS + 1): b"/a", b"x": b"/" * (MAX_ADAPTER_PATH_CHARS + 1)}
    assert runtime_adapters(raw) == {"sql": "/a/sql"}
    many = {f"a{i:04d}".encode(): b"/a" for i in range(MAX_RUNTIME_ADAPTERS + 10)}
    assert len(runtime_adapters(many)) == MAX_RUNTIME_ADAPTERS


class FakeReplica:
    """A replica keeping its adapters as `kvscale serve --allow-runtime-lora-updating` does: a load
    of a name it has is a 400, an unload of one it lacks a 404, /v1/models lists them; it refuses
    to load the names in ``refuse`` (a path its node cannot read) and answers a completion with its
    name. A load takes ``load_s`` (reading the files). ``restart`` brings it back on its port
    without any adapter, as a new pod."""

    def __init__(self, name: str, refuse: frozenset[str] = frozenset(), load_s: float = 0.0) -> None:
        self.name, self.refuse, self.load_s, self.port = name, refuse, load_s, free_port()
        self.adapters: dict[str, str] = {}
        self.loads: list[tuple[str, str, str | None]] = []  # (name, path, authorization)
        self.server: ThreadingHTTPServer | None = None
        self.updates = threading.Lock()  # one update at a time, as the server runs them
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                cards = [{"id": "base"}, *({"id": n, "parent": "base"} for n in fake.adapters)]
                self._answer(200, {"object": "list", "data": cards})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/v1/completions":
                    return self._answer(200, {"served_by": fake.name, "model": body["model"]})
                with fake.updates:
                    self._update(body["lora_name"], body.get("lora_path", ""))

            def _update(self, name: str, path: str) -> None:
                if self.path == f"/v1/{LOAD}":
                    fake.loads.append((name, path, self.headers.get("authorization")))
                    if name in fake.refuse or name in fake.adapters:
                        return self._answer(400, {"error": {"message": f"cannot load {name}", "type":
                                                            "BadRequestError", "param": "lora_path", "code": None}})
                    time.sleep(fake.load_s)
                    fake.adapters[name] = path
                elif fake.adapters.pop(name, None) is None:
                    return self._answer(404, {"error": {"message": f"no {name}", "type": "NotFoundError",
                                                        "param": "lora_name", "code": "model_not_found"}})
                self._answer(200, None)

            def _answer(self, status: int, body: dict | None) -> None:
                text = json.dumps(body) if body is not None else "Success: LoRA adapter updated successfully."
                self.send_response(status)
                self.send_header("content-type", "application/json" if body is not None else "text/plain")
                self.send_header("content-length", str(len(text.encode())))
                self.end_headers()
                self.wfile.write(text.encode())

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def restart(self) -> None:
        self.stop()
        self.adapters, self.loads = {}, []
        self.start()


def _post(url: str, update: str, **body: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/{update}", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=10)


def _health(url: str) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(f"{url}/health").json()["replicas"]}


def _replays(url: str, result: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'kvscale_router_lora_replays_total{{result="{result}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no kvscale_router_lora_replays_total{{result={result!r}}} series")


def _until(what: str, done: Callable[[], object], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _router(routers: Any, replicas: list[FakeReplica], redis_url: str | None = None,
            up: list[FakeReplica] | None = None) -> str:
    """A router over ``replicas``, once those ``up`` (all by default) are healthy."""
    url = routers.start(RouterConfig(
        replicas=[r.url for r in replicas], policy="round-robin", models=[], health_interval_s=0.2,
        api_key=KEY, replica_api_key="replica-key", allow_runtime_lora_updating=True, redis_url=redis_url))
    urls = {r.url for r in (replicas if up is None else up)}
    _until("the replicas never became healthy", lambda: all(
        r["healthy"] for url_, r in _health(url).items() if url_ in urls))
    return url


@pytest.fixture
def fakes():
    started: list[FakeReplica] = []

    def make(name: str, refuse: frozenset[str] = frozenset(), load_s: float = 0.0) -> FakeReplica:
        started.append(FakeReplica(name, refuse, load_s))
        return started[-1]

    yield make
    for fake in started:
        fake.stop()


def test_a_replica_that_comes_back_gets_the_adapters_loaded_through_the_router(in_process_routers: Any, fakes: Any) -> None:
    a, b = fakes("a"), fakes("b")
    router = _router(in_process_routers, [a, b])
    assert _post(router, LOAD, lora_name="sql", lora_path="/adapters/sql").status_code == 200
    # Served at once, without Redis heartbeats: the replicas answered the load.
    assert all(r["adapters"] == ["sql"] for r in _health(router).values())
    assert _post(router, LOAD, lora_name="gone", lora_path="/adapters/gone").status_code == 200
    assert _post(router, UNLOAD, lora_name="gone").status_code == 200  # out of the record
    b.stop()  # its pod restarts: the router sees it down, then back without adapters
    _until("b never went down", lambda: not _health(router)[b.url]["healthy"])
    b.restart()
    _until("sql was never loaded onto b again", lambda: b.adapters == {"sql": "/adapters/sql"})
    assert b.loads == [("sql", "/adapters/sql", "Bearer replica-key")]  # the router's key, not gone
    _until("the router does not see sql on b", lambda: _health(router)[b.url]["adapters"] == ["sql"])
    assert _replays(router, "loaded") == 1 and _replays(router, "failed") == 0
    time.sleep(0.5)  # passes after it find nothing lacking: no load again
    assert len(b.loads) == 1 and len(a.loads) == 2


def test_a_replica_lacking_an_adapter_gets_none_of_its_requests_while_its_load_fails(in_process_routers: Any, fakes: Any) -> None:
    a, b = fakes("a"), fakes("b", refuse=frozenset({"sql"}))
    b.stop()  # not up yet: it joins after the load
    router = in_process_routers.start(RouterConfig(
        replicas=[a.url, b.url], policy="round-robin", models=[], health_interval_s=0.2, api_key=KEY,
        replica_api_key="replica-key", allow_runtime_lora_updating=True))
    _until("a never became healthy", lambda: _health(router)[a.url]["healthy"])
    assert _post(router, LOAD, lora_name="sql", lora_path="/adapters/sql").status_code == 200
    b.start()
    _until("the failed replay was not retried", lambda: _replays(router, "failed") >= 2)
    assert _replays(router, "loaded") == 0 and len(b.loads) >= 2 and not b.adapters
    assert _health(router)[b.url]["healthy"] and _health(router)[b.url]["adapters"] == []
    with httpx.Client(base_url=router, headers={"authorization": f"Bearer {KEY}"}, timeout=10) as client:
        def served_by(model: str) -> set[str]:  # round-robin: every candidate within 4
            return {client.post("/v1/completions", json={"model": model, "prompt": "x"}).json()["served_by"]
                    for _ in range(4)}

        assert served_by("sql") == {"a"}
        assert served_by("base") == {"a", "b"}  # b takes the base model's requests


def test_every_router_of_the_fleet_knows_its_adapters_from_redis(in_process_routers: Any, fakes: Any,
                                                                 session_redis: Any) -> None:
    store = redis.Redis.from_url(session_redis.url)
    store.delete(RUNTIME_ADAPTERS_KEY)
    try:
        a, c = fakes("a"), fakes("c", load_s=0.5)
        c.stop()  # joins after the load
        first = _router(in_process_routers, [a, c], session_redis.url, up=[a])
        second = _router(in_process_routers, [a, c], session_redis.url, up=[a])  # never sees the load
        assert _post(first, LOAD, lora_name="sql", lora_path="/adapters/sql").status_code == 200
        assert store.hgetall(RUNTIME_ADAPTERS_KEY) == {b"sql": b"/adapters/sql"}
        # The second router's view of a predates the load: it reads a's /v1/models, loads nothing.
        _until("the second router does not see sql on a", lambda: _health(second)[a.url]["adapters"] == ["sql"])
        # Both routers find c lacking sql and send the load (it takes c half a second): one load is
        # done, the other is a 400 after which c's /v1/models lists it: not a failure.
        c.start()
        _until("sql was never loaded onto c", lambda: c.adapters == {"sql": "/adapters/sql"})
        _until("a router does not see sql on c",
               lambda: all(_health(r)[c.url]["adapters"] == ["sql"] for r in (first, second)))
        assert [name for name, _, _ in c.loads] == ["sql", "sql"]
        assert sum(_replays(r, "loaded") for r in (first, second)) == 1
        assert [_replays(r, "failed") for r in (first, second)] == [0, 0]
        assert [name for name, _, _ in a.loads] == ["sql"]  # no router loaded onto a again
        assert _post(first, LOAD, lora_name="chat", lora_path="/adapters/chat").status_code == 200
        assert _post(first, UNLOAD, lora_name="chat").status_code == 200
        assert store.hgetall(RUNTIME_ADAPTERS_KEY) == {b"sql": b"/adapters/sql"}
    finally:
        store.delete(RUNTIME_ADAPTERS_KEY)
        store.close()


def test_at_zero_replicas_an_adapter_loaded_at_run_time_is_held_until_a_replica_has_it(
        in_process_routers: Any, fakes: Any, session_redis: Any) -> None:
    store = redis.Redis.from_url(session_redis.url)
    store.delete(RUNTIME_ADAPTERS_KEY)
    try:
        store.hset(RUNTIME_ADAPTERS_KEY, "sql", "/adapters/sql")  # loaded through a router of the fleet
        b = fakes("b")
        b.stop()  # scaled to zero: no replica up, none that ever served sql known to this router
        router = in_process_routers.start(RouterConfig(
            # The bundled tokenizer (the default models): served names need one.
            replicas=[b.url], policy="round-robin", served_model_names=["base"],
            health_interval_s=0.2, api_key=KEY, replica_api_key="replica-key", allow_runtime_lora_updating=True,
            redis_url=session_redis.url, hold_timeout_s=30))
        time.sleep(0.5)  # the record read from Redis at the router's health passes
        auth = {"authorization": f"Bearer {KEY}"}
        unknown = httpx.post(f"{router}/v1/completions", json={"model": "other", "prompt": "x"}, headers=auth)
        assert unknown.status_code == 404  # a name no router loaded: at once, not held
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{router}/v1/completions", json={"model": "sql", "prompt": "x"}, headers=auth, timeout=30)))
        sender.start()
        _until("the request was not held", lambda: answers or httpx.get(f"{router}/health").json()["activation"]["held"])
        assert not answers, (answers[0].status_code, answers[0].text)
        b.start()  # comes up without the adapter: loaded onto it, then the request is answered
        sender.join(30)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
        assert answers[0].json() == {"served_by": "b", "model": "sql"}
        assert b.adapters == {"sql": "/adapters/sql"}
    finally:
        store.delete(RUNTIME_ADAPTERS_KEY)
        store.close()
