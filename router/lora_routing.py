"""A request's LoRA adapter as the router sees it: which replicas serve it, the base model whose
tokenizer renders its prompt, and how ready each replica is to run it (docs/router.md, "LoRA
adapters").

A replica's adapters are its heartbeat's where it publishes them (they follow loads and unloads at
run time), else its /v1/models' (the cards with a ``parent``, read at its first health check).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.candidates import LORA_FREE_SLOT, LORA_RESIDENT, lora_affinity
from kvscale.router.replicas import Replica


@dataclass(frozen=True)
class Adapter:
    """The adapter a request's ``model`` names, and the served name of its base model: the prompt
    is tokenized with the base's tokenizer and hashed with the base's block size and the adapter's
    name as the engine does (``kvscale.block_hash.first_block_keys``)."""

    name: str
    base: str


def adapters_of(replica: Replica, heartbeat: Heartbeat | None) -> Collection[str]:
    """The adapters ``replica`` serves now. A heartbeat with LoRA on (``max_loras``) names them
    all; one without (no Redis, LoRA off, or no stats yet) leaves /v1/models' list."""
    if heartbeat is not None and heartbeat.max_loras > 0:
        return heartbeat.lora_adapters
    return replica.adapters


def served_names(replica: Replica, heartbeat: Heartbeat | None) -> set[str]:
    """Every name ``replica`` answers to now: its base model's and its adapters' (``adapters_of``)."""
    return (replica.models - replica.adapters.keys()) | set(adapters_of(replica, heartbeat))


def serves(replica: Replica, heartbeat: Heartbeat | None, model: str) -> bool:
    """``replica`` answers requests for ``model``: one of its base model's names, or an adapter it
    has registered now."""
    if model in replica.models and model not in replica.adapters:
        return True
    return model in adapters_of(replica, heartbeat)


def request_adapter(
    model: str | None,
    serving: Sequence[Replica],
    heartbeat_of: Callable[[str], Heartbeat | None],
    tokenizers: Container[str],
) -> Adapter | None:
    """The adapter ``model`` names on the replicas ``serving`` it, None for a base model's name.
    Its base: the first of its /v1/models ``parent``, the replica's heartbeat model and its other
    served names that the router has a tokenizer for (else the parent, and the request then falls
    back to routing by load as any model without a tokenizer)."""
    if model is None or not serving:
        return None
    if any(model in r.models and model not in r.adapters for r in serving):
        return None
    fallback = ""
    for replica in serving:
        heartbeat = heartbeat_of(replica.replica_id)
        parent = replica.adapters.get(model, "")
        bases = [parent, heartbeat.model if heartbeat is not None else "",
                 *sorted(replica.models - replica.adapters.keys())]
        for base in bases:
            if base and base in tokenizers:
                return Adapter(model, base)
        fallback = fallback or next((base for base in bases if base), "")
    return Adapter(model, fallback or model)


def replica_affinity(adapter: str | None, heartbeat: Heartbeat | None) -> int:
    """How ready a replica is for ``adapter`` (``kvscale.router.candidates.lora_affinity``); without
    a heartbeat every replica that registered it is taken to have a slot free."""
    if adapter is None:
        return LORA_RESIDENT
    if heartbeat is None:
        return LORA_FREE_SLOT
    return lora_affinity(adapter, heartbeat.lora_resident, heartbeat.lora_running, heartbeat.max_loras)
