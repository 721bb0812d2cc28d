"""Where the predicted-TTFT policy sends a prompt nobody holds half of (docs/router.md, "Where a
new prefix goes"): pure functions over the candidates and their estimates.

Where some replica has room for the prompt beside its hot prefixes, and its recent traffic plus
the prompt still fit in its KV blocks, the prompt goes to the one of those whose recent traffic
claims least room (``new_prefix_home``), unless its queue truly overloads it (``busy_new_home``:
against the replicas with room, charged the blocks of recent traffic the prompt would evict).
Where none has, the groups outgrow the fleet's KV: a group this router has placed before goes back
to the replica it last sent the group to (``returning_home``; kvscale.router.decision.group_key), unless the spill
rule, nothing saved, has found that replica truly overloaded for the hold; a group it has not
placed, or whose home is overloaded, goes to the replica with the fewest groups homed there per
unit of its speed (``shared_home``): with no room anywhere, room cannot choose, and each replica
serves the misses of the groups it is home to.
Among replicas equal by those rules, a new group goes to the one a group last made its home longest
ago (``last_homed``): groups that arrive one after another go round the replicas, as cache_aware's
smallest tree sends them, and their cold prefills do not queue on one replica.
A prompt of a LoRA adapter readier on some replicas goes where it is readiest (``adapter_home``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

from kvscale.router.candidates import Candidate
from kvscale.router.spill_rule import OverloadHold, evicted_blocks, prompt_blocks, should_spill

# The policy's ranking key (estimate, adapter readiness, cached blocks, load, rendezvous hash).
RankKey = Callable[[Candidate], tuple[float, int, int, int, int]]
# Rates within this factor of the pool's median are one speed to the group share (``share_speeds``).
SAME_SPEED = 1.5


def new_prefix_home(roomy: Sequence[Candidate], need: int, key: RankKey) -> Candidate | None:
    """Where a prefix nobody holds goes, among the replicas with room for it: the one whose recent
    traffic claims least room, recent_blocks + need, in blocks (ties to the replica a group last
    made its home longest ago, the module's docstring, then by ``key``, the estimate first), as
    cache_aware places a prompt on its smallest tree: the prefixes recently sent are the work the
    replica will be asked for again, the queue one instant. Speed does not weigh here (a
    prefix takes as much room on a slow replica; one its speed spared took its share later, cold
    and at once); its queue is weighed next (``busy_new_home``). Not filtered by the estimate: the
    heartbeat counts every request queued behind a prefix still being computed in full, so in a
    burst new groups piled onto the others past their room. Nothing fills a replica past its KV
    blocks (``kv_blocks``): where the recent traffic plus this prompt fit somewhere, only those
    replicas are weighed. None when ``roomy`` is empty."""
    if not roomy:
        return None
    return min(fitting(roomy, need) or roomy, key=lambda c: (c.recent_blocks + need, c.last_homed, key(c)))


def fitting(roomy: Sequence[Candidate], need: int) -> list[Candidate]:
    """The replicas where the recent traffic plus a prompt of ``need`` blocks fit in the KV blocks
    (a replica that does not say how many it has, ``kv_blocks`` 0, fits)."""
    return [c for c in roomy if c.kv_blocks <= 0 or c.recent_blocks + need <= c.kv_blocks]


def own_prefill_units(candidate: Candidate, seconds: float, prompt_tokens: int, rate: float) -> float:
    """``seconds`` in units of the replica's own prefill of the whole prompt (its rate, its
    calibration scale): how many times over its queue delays a prompt nobody holds. A slower
    replica's longer prefill counts 1, as a faster one's does; a slowdown common to the fleet
    cancels."""
    alone = max(prompt_tokens, 1) / rate * candidate.ttft_scale
    return seconds / alone if alone > 0 else seconds


def busy_new_home(
    home: Candidate,
    roomy: Sequence[Candidate],
    prompt_tokens: int,
    block_size: int,
    rates: Mapping[str, float],
    ttft: Mapping[str, float],
    slack: float,
    key: RankKey,
) -> Candidate:
    """Where a prefix nobody holds goes once its home (``new_prefix_home``) is chosen: the home,
    unless the spill rule (nothing saved) finds it truly overloaded against another replica where
    the prompt has room beside the hot prefixes; then the one of those with the least delay. The
    home was chosen for the work its group will bring, by the room it claims; its queue now is
    what this rule weighs: each replica's estimate in units of its own prefill of the prompt
    (``own_prefill_units``), so a slower replica is not found overloaded for being slower (its
    prefill of the prompt is longer wherever it queues) and a uniform slowdown cancels. Without it,
    a home with the least claimed room took every new group that arrived while its queue held the
    last one's cold prefill: in a bursty stream, a replica whose groups had not come back within
    the hot window looked empty and took two at once.

    Another replica where the prompt has room but does not fit beside its recent traffic is charged,
    as the spill rule charges a spill's other (``evicted_blocks``), the prefill of the blocks of that
    traffic it would evict. Weighing only the replicas where it fits, the one replica that fitted
    took the group whatever its queue: the half-speed replica took a new group's 1,056-token prompt
    behind five requests already waiting there, each of them then waited for that prefill too (50 s
    at half speed; the simulated grid's c8-p1024-fits-throttled-random cell, TTFT p90 1.37 x the
    better baseline's; docs/performance.md, "The routing grid")."""
    others = [c for c in roomy if c.replica_id != home.replica_id]
    if not others:
        return home

    def delay(c: Candidate) -> float:
        evicted = evicted_blocks(c, prompt_tokens, block_size) * block_size
        return ttft[c.replica_id] + evicted / rates[c.replica_id] * c.ttft_scale

    def units(c: Candidate) -> float:
        return own_prefill_units(c, delay(c), prompt_tokens, rates[c.replica_id])

    best = min(others, key=lambda c: (round(units(c), 6), key(c)))
    overloaded = (should_spill(units(home), units(best), 0.0, slack)
                  and should_spill(delay(home), delay(best), 0.0, slack))
    return best if overloaded else home


def returning_home(
    by_estimate: Sequence[Candidate], last_home: str | None, ttft: Mapping[str, float], slack: float,
    hold: OverloadHold | None = None,
) -> tuple[Candidate | None, tuple[str, bool] | None]:
    """Where a prompt nobody holds goes when no replica has room for it, and the verdict on its home
    for the hysteresis (replica, overloaded): the replica this router last sent its group to,
    unless the spill rule (nothing saved) finds it truly overloaded against the best other
    estimate and has for ``hold`` (as a holder is passed over; None: at once). With no room anywhere
    the fleet cannot hold every group at once; a group sent wherever the queue is shortest finds a
    replica that evicted it, and evicts another group there, so each replica ends up seeing every
    group. Kept on one replica, as cache_aware keeps a group for good, its requests find there what
    it computed for the last one while that is still in its LRU; a queue that drains within the
    hold does not move it. (None, None) without a last home among ``by_estimate`` (the replicas
    under the load cap)."""
    home = next((c for c in by_estimate if c.replica_id == last_home), None)
    if home is None:
        return None, None
    other = next((c for c in by_estimate if c.replica_id != home.replica_id), None)
    if other is None:
        return home, None
    overloaded = should_spill(ttft[home.replica_id], ttft[other.replica_id], 0.0, slack)
    lasted = hold is None or hold.outlasted(home.replica_id, ttft[other.replica_id])
    return (None if overloaded and lasted else home), (home.replica_id, overloaded)


def share_speeds(rates: Mapping[str, float]) -> dict[str, float]:
    """Each replica's speed as the group share weighs it: its rate where that differs from the
    pool's median by more than SAME_SPEED, else the median. A heartbeat's prefill rate is a short
    moving average whose steps' mix moves it (short cache-hit steps pay a step's fixed cost for
    few tokens): in the real routing grid identical replicas published rates up to 1.7 x apart,
    for minutes, and weighed as they were, the share sent a fifth group to the replica that read
    2,023 tokens/s while one that read 1,589 kept three (docs/router.md, "Where a new prefix
    goes")."""
    if not rates:
        return {}
    median = statistics.median(rates.values())
    return {rid: median if median / SAME_SPEED <= rate <= median * SAME_SPEED else rate
            for rid, rate in rates.items()}


def shared_home(candidates: Sequence[Candidate], rates: Mapping[str, float], key: RankKey) -> Candidate | None:
    """Where a group goes when no replica has room for it and it has no home to return to (or its
    home is truly overloaded): the replica whose share of the groups, this one included, is least
    per unit of its speed (``share_speeds``), ``(homed_groups + 1) / speed``; ties to the least room
    claimed by recent traffic, then to the replica a group last made its home longest ago, then
    ``key``. With no room anywhere most of a group's requests miss wherever they go, so a
    replica's work is the misses of the groups it is home to, and a replica at half speed takes
    half the share. By recent claims alone, a replica whose groups had not come back within the
    hot window looked empty and took new groups beyond its share (c4-p256-over: 5 groups against
    3 and 4), and the half-speed replica took a full share; the simulated routing grid's "over"
    cells, docs/performance.md, "Routing". None without candidates."""
    if not candidates:
        return None
    speeds = share_speeds({c.replica_id: rates[c.replica_id] for c in candidates})
    return min(candidates, key=lambda c: (round((c.homed_groups + 1) / speeds[c.replica_id], 9),
                                          c.recent_blocks, c.last_homed, key(c)))


def cold_home(
    by_estimate: Sequence[Candidate],
    prompt_tokens: int,
    block_size: int,
    rates: Mapping[str, float],
    ttft: Mapping[str, float],
    slack: float,
    key: RankKey,
    last_home: str | None = None,
    hold: OverloadHold | None = None,
) -> tuple[Candidate | None, tuple[str, bool] | None]:
    """Where a prompt nobody holds goes (the module's docstring), and the verdict on a returning
    group's home for the hysteresis (None where there was none)."""
    need = prompt_blocks(prompt_tokens, block_size)
    roomy = [c for c in by_estimate if c.free_blocks is None or c.free_blocks >= need]
    judged = None
    if not fitting(roomy, need):
        # No room where the prompt fits: placed by room alone, every group outgrowing the fleet
        # went to the one replica whose groups had not come back twice within the hot window
        # (docs/router.md, "Where a new prefix goes").
        back, judged = returning_home(by_estimate, last_home, ttft, slack, hold)
        return (back if back is not None else shared_home(by_estimate, rates, key)), judged
    home = new_prefix_home(roomy, need, key)
    if home is None:
        return None, judged
    return busy_new_home(home, roomy, prompt_tokens, block_size, rates, ttft, slack, key), judged


def adapter_home(by_estimate: Sequence[Candidate], ttft: Mapping[str, float], slack: float) -> Candidate | None:
    """Where a prompt nobody holds goes when its LoRA adapter is readier on some replicas than on
    others (``lora_affinity``): the readiest with the lowest estimate, unless the spill rule (nothing
    saved) finds it truly overloaded against the best less ready one, so a hot adapter spreads once
    the replicas holding it are busy. None where every replica is as ready (a base-model request)."""
    best = min((c.lora_affinity for c in by_estimate), default=0)
    home = next((c for c in by_estimate if c.lora_affinity == best), None)
    other = next((c for c in by_estimate if c.lora_affinity != best), None)
    if home is None or other is None:
        return None
    return None if should_spill(ttft[home.replica_id], ttft[other.replica_id], 0.0, slack) else home


__all__ = ["RankKey", "adapter_home", "busy_new_home", "cold_home", "fitting", "new_prefix_home",
           "own_prefill_units", "returning_home", "share_speeds", "shared_home"]
