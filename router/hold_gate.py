"""A request held while no replica can take it (scale from zero), and what the router reports of
its holds: the waiting itself, where router/activation.py keeps the counts and limits.

A held request waits until the replica table says a replica serving its model is up, then goes
on to routing; if that replica is gone again (or its models not known yet) when the request
looks, it is held again. It ends with a 503 and ``Retry-After`` when the hold queue is full or
the hold times out, and with nothing (499) for a client that left (docs/operator.md, "Scale to
and from zero").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from kvscale.kv_index_schema import Heartbeat
from kvscale.router import activation as holding
from kvscale.router.errors import openai_error
from kvscale.router.lora_routing import serves
from kvscale.router.replicas import Replica

if TYPE_CHECKING:
    from kvscale.router.config import RouterConfig


async def hold_until_ready(activation: holding.Activation, request: Request, model: str | None,
                           available: Callable[[str | None], bool], *, worth_holding: bool,
                           refuse: Callable[[str], Response]) -> Response | None:
    """None when the request may go on to routing (a replica is ready, or came up while it was
    held, or ``model`` is not one worth holding for); else the answer ``refuse`` builds, or 499."""
    activation.touch()
    if available(model) or not worth_holding:
        return None
    if holding.admission(False, activation.held, activation.limits) == holding.FULL:
        activation.refused()
        return refuse(f"{activation.held} requests are already held for a replica "
                      "to come up (the hold queue is full)")
    deadline = time.monotonic() + activation.limits.timeout_s
    while not available(model):
        outcome = await activation.hold(request.is_disconnected, max(0.0, deadline - time.monotonic()))
        if outcome == holding.DISCONNECTED:
            return Response(status_code=499)  # nobody reads it: the client has gone
        if outcome == holding.TIMEOUT:
            return refuse(f"no replica became ready within {activation.limits.timeout_s:g} s "
                          "(the service is scaling up from zero)")
        await asyncio.sleep(0)  # let the sync loop see what this request saw
    return None


def worth_holding(model: str | None, config: RouterConfig, any_up: bool,
                  runtime_adapters: Collection[str] = ()) -> bool:
    """Whether a request for ``model`` is worth holding: one of the names the servers will serve
    (unknown names are answered 404 at once, as with replicas up), or one of their LoRA adapters
    while no replica is up at all (``any_up``): those given at start (--lora-adapter-names) and
    those loaded at run time through the fleet's routers (``runtime_adapters``, the record that
    router/lora_replay.py loads onto every replica that comes up). A replica up without it is an
    answer (404), not a replica still to come (docs/operator.md, "LoRA adapters"; docs/router.md,
    "Loading adapters at run time")."""
    if model is not None and (model in config.lora_adapter_names or model in runtime_adapters):
        return not any_up
    served = config.served_model_names
    return model is None or not served or model in served


def can_take(replicas: Iterable[Replica], model: str | None,
             heartbeat_of: Callable[[str], Heartbeat | None], routable: Callable[[Replica], bool]) -> bool:
    """A replica can take a request for ``model`` (None: any) now, as routing will find it: its
    models known (its first health check passed), serving ``model`` as ``lora_routing.serves``
    says (an adapter loaded at run time once its heartbeat names it, where it heartbeats), and
    healthy or routable. A held request released any earlier would be answered 404."""
    return any(r.models and (model is None or serves(r, heartbeat_of(r.replica_id), model))
               and (r.healthy or routable(r)) for r in replicas)


def refusal(activation: holding.Activation, message: str) -> Response:
    """The 503 a refused hold gets, with the Retry-After the last cold start suggests."""
    response = openai_error(503, message, "service_unavailable")
    response.headers["Retry-After"] = str(holding.retry_after_s(activation.last_cold_start_s, activation.limits))
    return response


def activation_report(activation: holding.Activation | None, replicas: list[Replica],
                      started: float) -> dict[str, Any]:
    """What the operator reads from /health: held requests and how long this router has seen no
    request open or held (the idle window before scaling to zero)."""
    open_requests = sum(r.in_flight for r in replicas)
    held = activation.held if activation is not None else 0
    last = activation.last_activity if activation is not None else started
    last = max([last, *(r.last_finished for r in replicas)])
    return {"enabled": activation is not None, "held": held,
            "idle_seconds": round(holding.idle_seconds(time.monotonic(), last, open_requests, held), 3),
            "last_cold_start_seconds": None if activation is None else activation.last_cold_start_s,
            # How long ago it ended: the operator records a scale from zero that began and ended
            # between two of its scrapes (a router raises the scale itself, router/wake.py).
            "last_cold_start_ago_seconds": None if activation is None or activation.last_cold_start_ended is None
            else round(time.monotonic() - activation.last_cold_start_ended, 3)}
