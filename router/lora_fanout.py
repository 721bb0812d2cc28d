"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` through the router: passed on to
every replica it routes to, one aggregate answer back (docs/router.md, "Loading adapters at run
time").

Served only with the router's ``--allow-runtime-lora-updating``, as a replica serves them only with
its own: without it the paths are the router's 404 for a path it has no route for, the answer the
server gives. The answer is 200 when every replica succeeded, else the first failure's status (in
replica id order) with OpenAI's error body naming each replica that failed and why. A load that
succeeded on any replica is recorded, and an unload takes it out of the record, for the replicas
that join later (router/lora_replay.py); each replica that answered 2xx is taken to serve the
adapter, or no longer to, at once.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvscale.router.errors import openai_error, request_json
from kvscale.router.lora_replay import (
    LOAD_READ_TIMEOUT_S,
    AdapterReplay,
    note_loaded,
    note_unloaded,
    update_refusal,
)
from kvscale.router.proxy import replica_headers

if TYPE_CHECKING:
    from kvscale.router.app import Router

UPDATES = ("load_lora_adapter", "unload_lora_adapter")
MESSAGE_CHARS = 300  # of one replica's error, in the aggregate's message


@dataclass(frozen=True)
class ReplicaAnswer:
    replica_id: str
    url: str
    status: int  # 502: the replica could not be reached
    text: str  # its body: the success line, or its error JSON


def error_of(text: str) -> dict[str, Any]:
    """A replica's error object (OpenAI's ``error``), or one made of its text when it is not JSON."""
    try:
        error = json.loads(text)["error"]
        if isinstance(error, dict):
            return error
    except (ValueError, KeyError, TypeError):
        pass
    return {"message": text, "type": "server_error", "code": None}


def aggregate(update: str, answers: list[ReplicaAnswer]) -> Response:
    """The router's one answer for the replicas' answers to ``update`` (a name in UPDATES)."""
    answers = sorted(answers, key=lambda a: a.replica_id)
    failed = [a for a in answers if not 200 <= a.status < 300]
    done = [a.replica_id for a in answers if a not in failed]
    if not failed:
        line = answers[0].text.strip().rstrip(".") or "Success"
        return PlainTextResponse(f"{line} on {len(done)} replica(s): {', '.join(done)}.")
    first = error_of(failed[0].text)
    why = "; ".join(f"{a.replica_id} answered {a.status}: {str(error_of(a.text).get('message'))[:MESSAGE_CHARS]}"
                    for a in failed)
    kept = f" It succeeded on {', '.join(done)}." if done else ""
    answer = openai_error(
        failed[0].status, f"{update} failed on {len(failed)} of {len(answers)} replica(s): {why}.{kept}",
        str(first.get("type") or "server_error"), first.get("code"))
    body = json.loads(bytes(answer.body))
    body["error"]["param"] = first.get("param")
    body["replicas"] = [{"id": a.replica_id, "url": a.url, "status": a.status} for a in answers]
    return JSONResponse(body, status_code=answer.status_code)


async def _send(client: httpx.AsyncClient, url: str, replica_id: str, path: str, body: bytes,
                headers: dict[str, str]) -> ReplicaAnswer:
    try:
        response = await client.post(f"{url}{path}", content=body, headers=headers)
    # AttributeError: a connection the replica reset as it was made (proxy.sent says why).
    except (httpx.HTTPError, AttributeError) as exc:
        return ReplicaAnswer(replica_id, url, 502, f"cannot reach the replica: {type(exc).__name__} {exc}")
    return ReplicaAnswer(replica_id, url, response.status_code, response.text)


async def fan_out(router: Router, request: Request, update: str, replay: AdapterReplay) -> Response:
    """Pass ``update`` on to every healthy replica at once; the aggregate answer. ``replay`` keeps
    the record of what was loaded."""
    if (denied := router.tenancy.authenticate(request)) is not None:
        return denied
    raw = await request.body()
    if isinstance(body := request_json(raw), Response):
        return body
    if (refused := update_refusal(update, body, replay.record.adapters)) is not None:
        why, param = refused  # as the replica's own 400 for it, naming the field
        return JSONResponse({"error": {"message": why, "type": "invalid_request_error", "param": param,
                                       "code": None}}, status_code=400)
    replicas = sorted((r for r in router.replicas.replicas.values() if r.healthy), key=lambda r: r.replica_id)
    if not replicas:
        return openai_error(503, f"no healthy replica to pass {update} on to", "service_unavailable")
    tenant = router.tenancy.tenant_of(request)
    headers = replica_headers(request.headers, router.config.replica_api_key, tenant.name if tenant else None)
    timeout = httpx.Timeout(connect=router.config.connect_timeout_s, read=LOAD_READ_TIMEOUT_S,
                            write=30.0, pool=30.0)
    name = body["lora_name"]
    if update == "unload_lora_adapter":  # first: a replay pass meanwhile must not load it again
        await replay.record.unloaded(name)
    async with httpx.AsyncClient(timeout=timeout) as client:
        answers = await asyncio.gather(*(_send(client, r.url, r.replica_id, f"/v1/{update}", raw, headers)
                                         for r in replicas))
    for replica, answer in zip(replicas, answers, strict=True):
        if 200 <= answer.status < 300:
            (note_loaded if update == "load_lora_adapter" else note_unloaded)(replica, name)
    if update == "load_lora_adapter" and any(200 <= a.status < 300 for a in answers):
        await replay.record.loaded(name, body["lora_path"])
    return aggregate(update, list(answers))


def update_routes(router: Router) -> list[Route]:
    """The two routes, or none without ``--allow-runtime-lora-updating``."""
    if not router.config.allow_runtime_lora_updating:
        return []
    replay = AdapterReplay(router)
    router.replicas.followers.append(replay)  # after every health pass; closed with the replicas
    router.runtime_adapters = replay.record  # what a request is held for at zero replicas

    def endpoint(update: str) -> Any:
        async def handle(request: Request) -> Response:
            return await fan_out(router, request, update, replay)
        return handle

    return [Route(f"/v1/{update}", endpoint(update), methods=["POST"]) for update in UPDATES]
