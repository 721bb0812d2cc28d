"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` through the router (router/lora_fanout.py):
passed on to every healthy replica, one aggregate answer; behind the router's key; 404 without
`--allow-runtime-lora-updating`, as a server without it. Replicas are loopback HTTP servers that
answer as `kvscale serve` does; the router is its app served by uvicorn in this process."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from reset_transport import ResetAsMade

from kvscale.processes import free_port
from kvscale.router.config import RouterConfig
from kvscale.router.lora_fanout import ReplicaAnswer, _send, aggregate

KEY = "router-key"


def _replica(refuse: set[str], cards: tuple[dict, ...] = ()) -> tuple[ThreadingHTTPServer, list[tuple[str, dict]]]:
    """A replica serving ``cards`` beside its base model that records each update and refuses (404,
    the server's error body) the names in ``refuse``."""
    seen: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(200, "application/json", json.dumps({"object": "list", "data": [{"id": "base"}, *cards]}))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.path, {**body, "auth": self.headers.get("authorization")}))
            if body["lora_name"] in refuse:
                error = {"message": f"The LoRA adapter `{body['lora_name']}` cannot be found.",
                         "type": "invalid_request_error", "param": "lora_name", "code": "model_not_found"}
                self._answer(404, "application/json", json.dumps({"error": error}))
            else:
                self._answer(200, "text/plain", f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

        def _answer(self, status: int, content_type: str, text: str) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(text.encode())))
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture(scope="module")
def fleet(in_process_routers):
    replicas = [_replica(set(), ({"id": "chat", "parent": "base"},)), _replica({"only-on-a"})]
    urls = [f"http://127.0.0.1:{server.server_address[1]}" for server, _ in replicas]
    common = {"replicas": urls, "policy": "round-robin", "models": [], "health_interval_s": 0.5,
              "api_key": KEY, "replica_api_key": "replica-key"}
    on = in_process_routers.start(RouterConfig(allow_runtime_lora_updating=True, **common))
    off = in_process_routers.start(RouterConfig(**common))
    deadline = time.monotonic() + 20
    while len(httpx.get(f"{on}/health").json()["replicas"]) < 2 or \
            not all(r["healthy"] for r in httpx.get(f"{on}/health").json()["replicas"]):
        assert time.monotonic() < deadline, "the replicas never became healthy"
        time.sleep(0.1)
    yield on, off, [seen for _, seen in replicas], urls
    for server, _ in replicas:
        server.shutdown()


def _post(url: str, update: str, key: str | None = KEY, **body: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/{update}", json=body, headers=headers, timeout=10)


def test_an_update_goes_to_every_replica_and_one_answer_comes_back(fleet) -> None:
    on, off, seen, _ = fleet
    answer = _post(on, "load_lora_adapter", lora_name="sql", lora_path="/adapters/sql")
    assert answer.status_code == 200, answer.text
    assert answer.text.startswith("Success: LoRA adapter 'sql' added successfully on 2 replica(s)")
    for replica in seen:  # the body as sent, with the router's key for the replicas
        assert replica[-1] == ("/v1/load_lora_adapter",
                               {"lora_name": "sql", "lora_path": "/adapters/sql", "auth": "Bearer replica-key"})
    assert _post(on, "unload_lora_adapter", lora_name="sql").status_code == 200
    assert [s[-1][0] for s in seen] == ["/v1/unload_lora_adapter"] * 2


def test_health_lists_each_replicas_adapters(fleet) -> None:
    # What the operator's status.adapters counts (operator/adapter_status.py).
    on, _, _, urls = fleet
    adapters = {r["url"]: r["adapters"] for r in httpx.get(f"{on}/health").json()["replicas"]}
    assert adapters == {urls[0]: ["chat"], urls[1]: []}


def test_a_failure_on_one_replica_names_it(fleet) -> None:
    on, _, seen, urls = fleet
    answer = _post(on, "unload_lora_adapter", lora_name="only-on-a")
    assert answer.status_code == 404
    body = answer.json()
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "lora_name"
    failed = urls[1].removeprefix("http://")
    assert f"failed on 1 of 2 replica(s): {failed} answered 404" in body["error"]["message"]
    assert f"It succeeded on {urls[0].removeprefix('http://')}." in body["error"]["message"]
    assert {r["id"]: r["status"] for r in body["replicas"]} == {urls[0].removeprefix("http://"): 200, failed: 404}


def test_the_key_and_the_flag_guard_it(fleet) -> None:
    on, off, seen, _ = fleet
    before = [len(s) for s in seen]
    assert _post(on, "load_lora_adapter", key=None, lora_name="x", lora_path="/x").status_code == 401
    assert _post(on, "load_lora_adapter", key="wrong", lora_name="x", lora_path="/x").status_code == 401
    for update in ("load_lora_adapter", "unload_lora_adapter"):  # as a server without the flag
        refused = _post(off, update, lora_name="x", lora_path="/x")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
    assert _post(on, "load_lora_adapter", lora_name="x", lora_path="/x").status_code == 200
    assert [len(s) for s in seen] == [n + 1 for n in before]  # only the allowed one reached them


def test_an_unreachable_replica_is_a_502_naming_it() -> None:
    answers = [ReplicaAnswer("b:1", "http://b:1", 502, "cannot reach the replica: ConnectError"),
               ReplicaAnswer("a:1", "http://a:1", 200, "Success: LoRA adapter 'x' added successfully.")]
    answer = aggregate("load_lora_adapter", answers)
    body = json.loads(bytes(answer.body))
    assert answer.status_code == 502 and body["error"]["type"] == "server_error"
    assert "b:1 answered 502: cannot reach the replica" in body["error"]["message"]
    assert "It succeeded on a:1." in body["error"]["message"]


def test_a_replica_that_resets_the_connection_as_it_is_made_is_a_502_not_the_routers_500() -> None:
    """anyio raises AttributeError (its socket already gone), not an httpx error, when a replica
    resets the connection as it is made; the fan-out answers for that replica as unreachable."""
    async def go() -> ReplicaAnswer:
        async with httpx.AsyncClient(transport=ResetAsMade("http://127.0.0.1:9")) as client:
            return await _send(client, "http://127.0.0.1:9", "r:9", "/v1/load_lora_adapter", b"{}", {})

    answer = asyncio.run(go())
    assert answer.status == 502 and "cannot reach the replica" in answer.text, answer
