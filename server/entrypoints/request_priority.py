"""A request's ``priority`` field (vLLM's) on /v1/completions and /v1/chat/completions.

Under ``--scheduling-policy priority`` any int within ±2**31 is taken, lower first
(server/core/priority_order.py). Under ``fcfs`` (the default) a non-zero priority is a 400 naming
the flag; 0 passes (docs/server.md, "Priority scheduling").
"""

from __future__ import annotations

from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.admission import priority_refusal
from kvscale.server.entrypoints.serving import OpenAIServer, bad_request


def request_priority(server: OpenAIServer, body: p.SamplingFields) -> int:
    """The priority the engine gets for ``body`` (0 when absent), or a 400 naming the field."""
    priority = 0 if body.priority is None else body.priority
    why = priority_refusal(priority, server.scheduling_policy)
    if why is not None:
        raise bad_request(f"{why}.", "priority")
    return priority
