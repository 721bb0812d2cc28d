"""One turn of an engine loop, between the loop's inbox and its step: what the engine core process
runs (engine_core.py) and what a test drives an engine on a thread with.

A loop takes everything queued since its last step in one go, adds a batch of requests all or
none, steps when there is work and hands each step's stats and KV events to the publisher. An
idle loop still wakes every ``IDLE_TICK_S`` so the publisher's heartbeat stays fresh.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Sequence
from typing import Any

from kvscale.server.outputs import EngineStats, RequestOutput
from kvscale.server.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_TICK_S = 1.0

# One request for the engine: (request id, prompt, sampling params, cache salt).
NewRequest = tuple[str, "str | list[int]", SamplingParams, "str | None"]


def take_all(inbox: queue.SimpleQueue, *, block: bool) -> list:
    """Everything queued for an engine loop between two steps (the core process's, or a test's
    thread's). ``block`` (nothing to run): wait for the first item, but at most IDLE_TICK_S, so
    an idle loop still publishes its heartbeat."""
    items = []
    try:
        if block:
            items.append(inbox.get(timeout=IDLE_TICK_S))
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return items


def step_and_publish(engine: Any, publisher: Any, *, had_input: bool,
                     last_publish: float) -> tuple[list[RequestOutput], EngineStats] | None:
    """An engine loop's turn after its inbox (the core process's, or a test's thread's): a step when
    there is work, then the stats and KV events handed to the publisher. None when idle, nothing
    came in and the heartbeat is not due yet (IDLE_TICK_S after ``last_publish``)."""
    outputs: list[RequestOutput] = []
    if engine.has_unfinished_requests():
        outputs = engine.step()
    elif not had_input and time.monotonic() - last_publish < IDLE_TICK_S:
        return None
    stats = engine.get_stats()
    events = engine.drain_kv_events()
    if publisher is not None:
        publisher.on_step(events=events, stats=stats, snapshot=engine.cached_block_hashes)
    return outputs, stats


def add_all(engine: Any, requests: Sequence[NewRequest], tenant: str = "", lora_name: str = "",
            priority: int = 0) -> BaseException | None:
    """Add every request to ``engine`` or none of them: None, or what refused the first.

    A batch is one HTTP request's prompts, so they share one admission group, named after the
    first (request ids are unique while they run), and its ``tenant`` (the router's, "" for
    none): the scheduler is fair across tenants, then groups, not across prompts
    (server/core/admission_order.py). They share the request's LoRA adapter too ("": the base model),
    and its priority (server/core/priority_order.py)."""
    added: list[str] = []
    group = requests[0][0] if len(requests) > 1 else ""
    try:
        for request_id, prompt, params, cache_salt in requests:
            engine.add_request(request_id, prompt, params, cache_salt=cache_salt, group=group,
                               tenant=tenant, lora_name=lora_name or None, priority=priority)
            added.append(request_id)
    except (ValueError, TypeError, OverflowError) as exc:
        error: BaseException = exc
    except AssertionError as exc:
        # The edge let through what the engine asserts against: a bug, but one request's.
        logger.exception("engine refused a request that passed the API's checks")
        error = RuntimeError(f"internal error: the engine refused this request ({exc})")
    else:
        return None
    for request_id in added:  # all or nothing
        engine.abort_request(request_id)
    return error
