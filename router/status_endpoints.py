"""What the router says of itself and its pool, answered without a replica: ``/v1/models``,
``/health`` (read by probes and the operator), ``/metrics`` and ``/ping``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvscale.router.lora_routing import adapters_of, served_names

if TYPE_CHECKING:
    from kvscale.router.app import Router


async def models(router: Router, request: Request) -> Response:
    if (denied := router.tenancy.authenticate(request)) is not None:
        return denied
    # An adapter loaded or unloaded at run time shows as the replica's heartbeat says (docs/router.md).
    names = sorted({m for r in router.replicas.replicas.values() if router.heartbeats.routable(r)
                    for m in served_names(r, router.heartbeats.get(r.replica_id))})
    if not names and router.activation is not None:
        # At zero replicas the model and its adapters are still served: a request wakes a replica.
        names = sorted(router.config.served_model_names) + sorted(router.config.lora_adapter_names)
    return JSONResponse({"object": "list", "data": [
        {"id": n, "object": "model", "created": 0, "owned_by": "kvscale"} for n in names]})


async def health(router: Router, request: Request) -> Response:
    if router.drain.draining:
        return JSONResponse(
            {"status": "draining", "policy": router.config.policy}, status_code=503)
    indexed = router.index.sizes()
    # index_blocks: what the operator's pod-deletion-cost weighs (the warm cache routed to).
    replicas = [
        {"url": r.url, "id": r.replica_id, "healthy": router.heartbeats.routable(r),
         "in_flight": r.in_flight, "models": sorted(r.models),
         "status": router.heartbeats.replica_status(r),
         "index_blocks": indexed.get(r.replica_id, 0),
         # Its LoRA adapters now: what the operator reports per adapter (status.adapters).
         "adapters": sorted(adapters_of(r, router.heartbeats.get(r.replica_id)))}
        for r in router.replicas.replicas.values()
    ]
    # Holding requests at zero replicas is serving: the router stays ready (its Service
    # keeps it) so that requests reach it and wake the servers.
    ok = any(r["healthy"] for r in replicas) or router.activation is not None
    feed = router.heartbeats.feed
    redis_state = None if feed is None else ("up" if feed.healthy else "down")
    tokenizers = [{"model": name, "loaded": error is None, **({"error": error} if error else {})}
                  for name, error in router.hasher.tokenizer_status().items()]
    return JSONResponse(
        {"status": "ok" if ok else "no healthy replica", "policy": router.config.policy,
         "redis": redis_state, "tokenizers": tokenizers, "replicas": replicas,
         "activation": router.activation_report(),
         # Requests waiting here for room (--max-queue-wait): the operator's autoscaler counts
         # them with the servers' waiting ones.
         "queued": router.queue.waiting if router.queue is not None else 0},
        status_code=200 if ok else 503,
    )


async def metrics(router: Router, request: Request) -> Response:
    router.sync_heartbeats()
    return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def ping(request: Request) -> Response:
    """Liveness: answered by the event loop itself, so a wedged loop fails it (a TCP probe is
    answered by the kernel, and /health is rightly 503 while no server is ready)."""
    return Response(status_code=200)
