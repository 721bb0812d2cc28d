"""The predicted-TTFT policy, the router's default: an estimate of each replica's time to first
token, and a rule that keeps a prefix where it is.

The estimate: for each replica, this request's time to first token
from what costs time there, in tokens and seconds rather than in requests:
  ttft(r) = (queued_prefill_tokens(r) + uncached_tokens(r)) / prefill_tokens_per_s(r)
            + decode_step_s(r) * steps(r)        (only while r has sequences decoding)
            + slot_wait(r)                       (only while the sequences ahead fill r's batch)
            + lora_wait(r)                       (only while other adapters hold r's LoRA slots)
  steps(r) = ceil((queued_prefill_tokens(r) + uncached_tokens(r)) / step_token_budget(r))
step_token_budget is the engine's max_num_batched_tokens: the queue ahead and our prompt share steps.
uncached_tokens is the prompt minus the leading blocks r holds, where a block r holds in its host
tier (demoted, --kv-offloading-size) counts as 1/HOST_RESTORE_SPEEDUP of a token to compute per
token: its restore is a copy, cheaper than its prefill, dearer than a tier-1 hit; the queued work is the
replica's heartbeat corrected by this router's own sends (kvscale.router.prefill_ledger); the rates are
the replica's own moving averages, each held within a factor RATE_SPREAD of the pool's median: a
replica serving cache hits runs short prefill steps whose fixed cost makes its tokens/s look low,
and believing that would make every holder of a hot prefix look slow (prediction error turned
into spreading). Every engine step that carries part of our prefill also runs every decode, so
each such step costs one decode step on top. slot_wait: when the sequences ahead (the heartbeat's
running + waiting, corrected by this router's sends) fill the batch (its max_num_seqs), the request
waits for one to end: the k-th soonest end of the decoding left there, from this router's own
record of its sends (its typical decode there, first byte to end, less what each has decoded);
``slot_wait_s``; counted only while some replica has a free slot. A replica that does not publish
its batch size has none.

The rule (why not simply the minimum): a prefix held on a replica stays there while the fleet can
hold its hot prefixes; spreading it buys nothing and costs a second copy in the KV pools and a
second prefill. The anchor is the session's replica (the session header) or else the holder of
the longest prefix (the lowest estimate among equal holders). It keeps the request unless it is
truly overloaded:
  ttft(anchor) > (1 + slack) * (ttft(other) + saved(other))
for the best other replica (where the anchor's KV holds the groups homed there, the best of those
whose KV holds one more beside theirs: kvscale.router.spill_rule.spill_others), where
saved(other) is the prefill of the blocks the anchor holds and the other does not, at the
other's rate. The other's estimate already pays that prefill once; the
rule asks the anchor's queue to cost it again, since the copy delays every request behind it on
the other replica too. ``slack`` (--balance-epsilon, spec.router.balanceEpsilon) is the tolerated
prediction error, relative; its hysteresis and the rule are kvscale.router.spill_rule. A prompt
nobody holds (or, of a group not placed before, holds under ``ANCHOR_SHARE`` of: a shared
opening alone anchors no new group) goes where
kvscale.router.cold_placement sends it: a replica with room for it beside
its hot prefixes (``free_blocks``: the replica's KV blocks less those this router sent there twice
or more within the hot window; kvscale.router.decision) where its recent traffic and the prompt
fit in its KV blocks, the least claimed, unless its queue truly overloads it; where none has room
it fits in, back to the replica its group was last sent to, unless that has been truly
overloaded for the hold, else the least claimed replica of all, and its LRU makes room there. Ties
(within 1 ms) go to the longer cached prefix, then to the rendezvous hash. The bounded-load cap
on in-flight requests (``ttft_epsilon``) stays a safety valve: a replica over it goes last
whatever it holds.

A LoRA adapter's request sees only the replicas that registered it. Its blocks are keyed by the
adapter, so the holder of its prefix is found as any other; a prompt of it nobody holds goes where
the adapter is readiest (resident in a device slot, else a slot free for it: ``adapter_home``)
unless that replica is truly overloaded, and estimates within 1 ms go to the readier replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from kvscale.router.candidates import (
    LORA_NO_SLOT,
    Candidate,
    Decision,
    Spill,
    bounded_split,
    rendezvous_weight,
)
from kvscale.router.cold_placement import adapter_home, cold_home
from kvscale.router.spill_rule import (
    OverloadHold,
    evicted_blocks,
    prompt_blocks,
    should_spill,
    spill_others,
)

# Safety valve for predicted-ttft: nobody above (1 + eps) x the mean in-flight requests. Loose on
# purpose: requests that hit a cached prefix are cheap, so a replica holding hot prefixes carries
# more of them without being overloaded (the spill rule judges overload, in seconds); at 1.0 this
# cap, not the rule, spread the prefixes of a workload the fleet could hold (simulated hit rate
# 0.73 against a ceiling of 0.89; docs/router.md, "predicted-ttft").
TTFT_EPSILON = 2.0
# Until a replica has measured itself (no heartbeat yet, or no prefill since it started).
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
# predicted-ttft trusts a replica's measured prefill rate within this factor of the pool's median.
RATE_SPREAD = 2.0
# predicted-ttft's default slack (the tolerated relative prediction error) before a holder spills.
TTFT_SLACK = 0.25
# A prompt of a group this router has not placed (no ``last_home``) whose longest cached prefix is
# under this share of its blocks is placed as a new one (cold_placement), its holders' saving left
# to the estimates: an opening every prompt shares (a system prompt) is held everywhere it went
# first, and anchoring each new prefix behind it to its first holder piled every group onto that
# replica (docs/router.md, "predicted-ttft"). cache_aware's match threshold is the same share, of
# characters. A group placed before keeps its holder, even one its LRU left a few blocks.
ANCHOR_SHARE = 0.5


# How many times faster restoring a block from a replica's host tier is than prefilling it:
# bench/kv_tier.py measures it (docs/performance.md, "Host KV tier": well above this on CPU); kept conservative,
# so a tier-1 holder is preferred to a tier-2 one and both to a replica that holds nothing.
HOST_RESTORE_SPEEDUP = 10.0


def predicted_ttft(
    candidate: Candidate,
    prompt_tokens: int,
    block_size: int,
    default_rate: float = DEFAULT_PREFILL_TOKENS_PER_S,
    slot_wait: float | None = None,
) -> float:
    """Seconds until this request's first token if sent to ``candidate`` (see the module doc);
    ``slot_wait``: the wait for a batch slot to add (None: ``slot_wait_s(candidate)``; the policy
    passes 0 where every replica's batch is full)."""
    # At least one token is always computed (the engine needs its logits).
    uncached = max(prompt_tokens - candidate.matched_blocks * block_size, 1)
    restore = min(candidate.host_blocks, candidate.matched_blocks) * block_size / HOST_RESTORE_SPEEDUP
    work = candidate.queued_prefill_tokens + uncached + restore
    rate = candidate.prefill_tokens_per_s if candidate.prefill_tokens_per_s > 0 else default_rate
    seconds = work / rate
    if candidate.num_decoding > 0 and candidate.decode_step_s > 0:
        per_step = candidate.step_token_budget if candidate.step_token_budget > 0 else work
        seconds += candidate.decode_step_s * math.ceil(work / max(per_step, 1.0))
    return seconds + (slot_wait_s(candidate) if slot_wait is None else slot_wait) + lora_wait_s(candidate)


def lora_wait_s(candidate: Candidate) -> float:
    """Seconds a request waits there for a slot for its LoRA adapter: 0 unless every slot is held
    by other adapters' running requests, then the soonest end of a running sequence this router can
    tell, at least one decode step (a lower bound: a slot frees when all of one adapter's requests
    have left the batch; docs/router.md, "LoRA adapters")."""
    if candidate.lora_affinity != LORA_NO_SLOT:
        return 0.0
    step = candidate.decode_step_s
    return max(min(candidate.decode_left_s, default=step), step)


def slot_wait_s(candidate: Candidate) -> float:
    """Seconds a request sent now waits for a batch slot (docs/router.md, "predicted-ttft"): 0 while
    the sequences ahead leave one free, or where the replica does not say its batch size. Else the
    k-th slot to free, k = sequences_ahead + 1 - batch_slots, at most the whole batch: the running
    sequences' decoding left, soonest first, the ones this router cannot tell (another router's)
    taken to end at the next step (a lower bound). A queue deeper than one batch adds nothing here:
    its prompts are in the queued prefill already, and counting their rounds of the batch as well
    made the simulated grid's deep-queue cells worse (docs/router.md, "predicted-ttft")."""
    slots = candidate.batch_slots
    k = candidate.sequences_ahead + 1 - slots
    if slots <= 0 or k <= 0:
        return 0.0
    step = candidate.decode_step_s
    known = sorted(max(x, step) for x in candidate.decode_left_s)[:slots]
    running = sorted(known + [step] * (slots - len(known)))
    return running[min(k, slots) - 1]


def pool_rates(candidates: Sequence[Candidate]) -> dict[str, float]:
    """Each replica's prefill rate for the estimate: its own, held within RATE_SPREAD of the pool's
    median measured rate; unmeasured replicas take the median (neither shunned nor flooded)."""
    measured = sorted(c.prefill_tokens_per_s for c in candidates if c.prefill_tokens_per_s > 0)
    if not measured:
        return {c.replica_id: DEFAULT_PREFILL_TOKENS_PER_S for c in candidates}
    median = measured[len(measured) // 2] if len(measured) % 2 else (
        measured[len(measured) // 2 - 1] + measured[len(measured) // 2]) / 2
    low, high = median / RATE_SPREAD, median * RATE_SPREAD
    return {c.replica_id: min(max(c.prefill_tokens_per_s, low), high) if c.prefill_tokens_per_s > 0 else median
            for c in candidates}


def predicted_ttft_policy(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    block_size: int,
    hash_key: int | str,
    *,
    epsilon: float | None = TTFT_EPSILON,
    slack: float = TTFT_SLACK,
    sticky_replica: str | None = None,
    ttft_overhead_s: float = 0.0,
    hold: OverloadHold | None = None,
    last_home: str | None = None,
) -> Decision:
    """Rank replicas: the anchor (session, else longest holder) first unless it is truly overloaded,
    cold prompts where there is room, the rest by estimate; over the load cap last.

    The estimates are calibrated (kvscale.router.ttft_calibration): each candidate's ``ttft_scale``
    times its estimate, and the prefill a hit saves on another replica times that replica's. The
    overhead every request pays wherever it goes (``ttft_overhead_s``) is added to the estimate the
    decision reports, not to the ones it compares: a time common to every replica must not change
    a decision (added to both sides of the spill rule it would make the holder keep more).
    ``last_home``: the replica this router last sent the prompt's group to (None: never,
    or forgotten), where a prompt nobody holds returns when no replica has room for it."""
    if not candidates:
        return Decision([], 0, "none")
    eligible: list[Candidate]
    over: list[Candidate]
    if epsilon is None:
        eligible, over = list(candidates), []
    else:
        eligible, over, _ = bounded_split(candidates, epsilon)
    rates = pool_rates(candidates)
    # The slot wait tells a full batch from a free slot; where every batch is full its estimate
    # (our own sends' typical decode) only adds noise to a comparison of queues the prefill term
    # already makes: at 4 slots a replica it cost the simulated grid's deep-queue cells hit rate
    # (docs/router.md, "predicted-ttft").
    waits = {c.replica_id: slot_wait_s(c) for c in candidates}
    slots = any(wait == 0.0 for wait in waits.values())
    raw = {c.replica_id: predicted_ttft(
        replace(c, prefill_tokens_per_s=rates[c.replica_id]), prompt_tokens, block_size,
        slot_wait=waits[c.replica_id] if slots else 0.0)
        for c in candidates}
    ttft = {c.replica_id: c.ttft_scale * raw[c.replica_id] for c in candidates}

    def key(c: Candidate) -> tuple[float, int, int, int, int]:
        return (round(ttft[c.replica_id], 3), c.lora_affinity, -c.matched_blocks, c.load,
                -rendezvous_weight(hash_key, c.replica_id))

    by_estimate = sorted(eligible, key=key)
    best_match = max((c.matched_blocks for c in candidates), default=0)
    # A group this router has placed keeps its holder, even one left with a few of its blocks.
    cold = best_match == 0 or (last_home is None
                               and best_match < ANCHOR_SHARE * prompt_blocks(prompt_tokens, block_size))
    reason = "load"
    anchor: Candidate | None = None
    spill: Spill | None = None
    judged: tuple[str, bool] | None = None
    sticky = [c for c in eligible if c.replica_id == sticky_replica]
    if sticky:
        anchor, reason = sticky[0], "sticky"
    elif not cold:
        anchor = next((c for c in by_estimate if c.matched_blocks == best_match), None)
        reason = "affinity" if anchor is not None else "load"
    if anchor is not None:
        others = [c for c in by_estimate if c.replica_id != anchor.replica_id]
        # A session's replica is presumed to hold its history (the client says so), even where the
        # index has not seen it (no Redis, or its events still on their way).
        held = (anchor.matched_blocks if reason != "sticky"
                else max(anchor.matched_blocks, prompt_tokens // max(block_size, 1)))
        # Only where a copy does not evict the groups homed there (kvscale.router.spill_rule).
        movable = spill_others(anchor, others, prompt_blocks(prompt_tokens, block_size), last_home)
        other = movable[0] if movable else None
        saved = 0.0
        if other is not None:
            # The prefill the hit saves, and the hot blocks the copy would evict there (computed
            # again by the requests that wanted them): both at the other's rate.
            lost = max(held - other.matched_blocks, 0) + evicted_blocks(other, prompt_tokens, block_size)
            saved = lost * block_size / rates[other.replica_id] * other.ttft_scale
        overloaded = other is not None and should_spill(
            ttft[anchor.replica_id], ttft[other.replica_id], saved, slack)
        judged = (anchor.replica_id, overloaded)
        # Before any wait is measured, the other's estimate is the wait the overload must outlast.
        # A full batch is no prediction error to smooth over: its slot wait alone overloading the
        # anchor moves the request at once (docs/router.md, "Hysteresis").
        lasted = hold is None or (other is not None and (
            hold.outlasted(anchor.replica_id, ttft[other.replica_id])
            or (slots and should_spill(anchor.ttft_scale * waits[anchor.replica_id], ttft[other.replica_id], saved, slack))))
        if other is not None and overloaded and lasted:
            spill = Spill(anchor.replica_id, ttft[anchor.replica_id], other.replica_id, ttft[other.replica_id],
                          saved, held)
            anchor, reason = other, "load"
    if anchor is None and cold and (home := adapter_home(by_estimate, ttft, slack)) is not None:
        anchor, reason = home, "lora"  # a cold prompt of an adapter readier on some replicas
    elif anchor is None and cold:  # a cold prompt (kvscale.router.cold_placement)
        anchor, returned = cold_home(by_estimate, prompt_tokens, block_size, rates, ttft, slack, key, last_home, hold)
        judged = returned or judged
    ranked = by_estimate
    if anchor is not None:
        ranked = [anchor] + [c for c in by_estimate if c.replica_id != anchor.replica_id]
    ranked += sorted(over, key=key)
    if reason == "load" and best_match > 0 and ranked[0].matched_blocks == best_match:
        reason = "affinity"
    return Decision([c.replica_id for c in ranked], ranked[0].matched_blocks, reason,
                    predicted_ttft_s=ttft_overhead_s + ttft[ranked[0].replica_id],
                    uncalibrated_ttft_s=raw[ranked[0].replica_id],
                    rate_measured=ranked[0].prefill_tokens_per_s > 0,
                    spill=spill if spill is not None and ranked[0].replica_id != spill.holder else None,
                    judged=judged)
