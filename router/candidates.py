"""What a routing policy ranks: one candidate replica as it sees it, the decision it returns, and
the building blocks every policy shares (the bounded-load rule of consistent hashing with bounded
loads, Mirrokni et al., and rendezvous hashing so routers agree without talking)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One routable replica as the policy sees it."""

    replica_id: str
    load: int  # in-flight requests: max(router's own count, heartbeat running + waiting)
    kv_usage: float = 0.0  # kv_blocks_active / kv_blocks_total from the heartbeat (0..1)
    matched_blocks: int = 0  # leading prompt blocks this replica holds
    host_blocks: int = 0  # of those, the ones in its host tier (restored by a copy, not free)
    # Prefill work queued there, in tokens: heartbeat corrected by this router's sends.
    queued_prefill_tokens: int = 0
    num_decoding: int = 0  # sequences past prefill (heartbeat, or what this router knows)
    # The replica's own moving averages; 0 while unmeasured.
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    step_token_budget: int = 0  # the engine's max_num_batched_tokens; 0: unknown (one step)
    # The batch's slots (the engine's max_num_seqs; 0: unknown, no slot wait), the sequences ahead
    # of a request sent now (running + waiting + this router's sends the heartbeat has not counted),
    # and the seconds of decoding left of the running ones this router can tell, soonest first
    # (kvscale.router.predicted_ttft.slot_wait_s; docs/router.md, "predicted-ttft").
    batch_slots: int = 0
    sequences_ahead: int = 0
    decode_left_s: tuple[float, ...] = ()
    # KV blocks not held by the prefixes recently routed there (None: unknown, room assumed).
    free_blocks: int | None = None
    # Distinct blocks this router sent there within the hot window: the room its recent traffic
    # claims, as cache_aware's tree size (docs/router.md, "Where a new prefix goes").
    recent_blocks: int = 0
    # The replica's KV blocks (the heartbeat's kv_blocks_total; 0: unknown): a new prefix goes
    # first where its recent traffic plus the prompt still fit in them.
    kv_blocks: int = 0
    # How much longer than predicted this replica's requests have taken, relative to the pool
    # (kvscale.router.ttft_calibration): its estimate is multiplied by it.
    ttft_scale: float = 1.0
    # How ready the replica is to run the request's LoRA adapter (``lora_affinity``): LORA_RESIDENT
    # for a base-model request.
    lora_affinity: int = 0
    # Prompts' leading blocks (their groups) this router last sent here, of those it remembers: the
    # replica's share of the groups where no replica has room for a new one (docs/router.md,
    # "with no room anywhere"; kvscale.router.cold_placement.shared_home).
    homed_groups: int = 0
    # When a group last made this replica its home, in the order of such moves over the fleet (0:
    # never): among replicas equal otherwise a new group goes to the one that took one longest ago
    # (kvscale.router.cold_placement).
    last_homed: int = 0


# A request's LoRA adapter on a replica that registered it, best first (docs/router.md, "LoRA
# adapters"): in a device slot now; a slot free for it (loading it evicts an idle adapter); every
# slot held by other adapters' running requests (it waits for one of them to leave the batch).
LORA_RESIDENT = 0
LORA_FREE_SLOT = 1
LORA_NO_SLOT = 2


def lora_affinity(adapter: str | None, resident: Collection[str], running: Collection[str], max_loras: int) -> int:
    """How ready a replica is for ``adapter`` (None: the base model, ready everywhere), from its
    heartbeat: the adapters resident in its slots, those of its running requests, its slots (0:
    not published, a slot assumed free). The engine puts at most ``max_loras`` adapters in one step,
    so a slot is free while fewer adapters run."""
    if adapter is None or adapter in resident or adapter in running:
        return LORA_RESIDENT
    if max_loras <= 0 or len(running) < max_loras:
        return LORA_FREE_SLOT
    return LORA_NO_SLOT


@dataclass(frozen=True)
class Spill:
    """Why a holder was passed over (predicted-ttft): the decision record the router logs and the
    benchmarks collect, in the estimate's seconds."""

    holder: str
    holder_ttft_s: float
    other: str  # the best other replica, where the request went
    other_ttft_s: float
    saved_s: float  # the prefill the holder's cached blocks would have saved there
    held_blocks: int


@dataclass(frozen=True)
class Decision:
    ranked: list[str]  # best first; the proxy walks it on failover
    matched_blocks: int  # of the first choice
    reason: str  # "affinity" | "lora" | "load" | "hash" | "sticky" | "round-robin" | "random"
    predicted_ttft_s: float | None = None  # predicted-ttft's estimate for the first choice (calibrated)
    uncalibrated_ttft_s: float | None = None  # the same before calibration
    # The first choice's estimate rests on its own measured prefill rate (not the pool's or the
    # default, which a replica that has not measured itself yet borrows).
    rate_measured: bool = False
    spill: Spill | None = None  # set when the policy passed a holder over for its load
    # The holder the spill rule judged, and whether it found it overloaded (the caller's hysteresis).
    judged: tuple[str, bool] | None = None


def effective_load(
    local_in_flight: int,
    heartbeat_load: int | None,
    heartbeat_time: float,
    last_local_finish: float,
) -> int:
    """A replica's load for the bound: this router's own count, raised by the heartbeat's.

    The heartbeat (running + waiting, once a second) also counts other routers' requests, but a
    heartbeat sent before a request of ours finished there still counts that request: believing
    it would push the replica over the bound and spill prompts away from the cache holding them.
    So a heartbeat older than our latest completion on that replica is ignored until the next one
    arrives (both times on this router's clock: the caller brings the heartbeat's onto it).
    """
    if heartbeat_load is None or heartbeat_time < last_local_finish:
        return local_in_flight
    return max(local_in_flight, heartbeat_load)


def bounded_capacity(loads: Sequence[int], epsilon: float) -> int:
    """Most in-flight requests any replica may hold after taking one more request."""
    if not loads:
        return 0
    mean_after = (sum(loads) + 1) / len(loads)
    return max(1, math.ceil((1.0 + epsilon) * mean_after))


def within_bound(load: int, capacity: int) -> bool:
    return load + 1 <= capacity


def rendezvous_weight(key: int | str, replica_id: str) -> int:
    """Highest-random-weight hash: stable across processes (no Python ``hash()``)."""
    digest = hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def consistent_hash_order(key: int | str, replica_ids: Sequence[str]) -> list[str]:
    return sorted(replica_ids, key=lambda rid: rendezvous_weight(key, rid), reverse=True)


def bounded_split(
    candidates: Sequence[Candidate], epsilon: float
) -> tuple[list[Candidate], list[Candidate], int]:
    capacity = bounded_capacity([c.load for c in candidates], epsilon)
    eligible = [c for c in candidates if within_bound(c.load, capacity)]
    over = [c for c in candidates if not within_bound(c.load, capacity)]
    return eligible, over, capacity
