"""The spill rule of the predicted-TTFT policy and its hysteresis: when a replica that would keep a
prefix (its holder, or the home a group returns to) is truly overloaded, and for how long it must
have been before the request goes elsewhere (docs/router.md, "predicted-ttft", "Hysteresis")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvscale.router.candidates import Candidate


@dataclass(frozen=True)
class OverloadHold:
    """Hysteresis for the spill rule: a holder is passed over only once the rule has judged it
    overloaded for ``hold_s`` without a break (``since``: replica -> when that began; the caller
    keeps it from each decision's ``judged``). A burst of one group that drains within it does not
    move the group; an overload that outlasts it does (docs/router.md, "Hysteresis")."""

    now: float
    hold_s: float
    since: Mapping[str, float]

    def outlasted(self, replica_id: str, predicted_wait_s: float = 0.0) -> bool:
        """``predicted_wait_s``: the wait the estimate predicts, the hold while none was measured
        yet. A fleet's first burst arrives in one instant, before any first token: its overload
        has lasted no time at all, and the heartbeat counts every sibling queued behind a prefix
        still being computed in full, so the holder of the busiest groups looks overloaded then."""
        hold_s = self.hold_s if self.hold_s > 0 else predicted_wait_s
        if hold_s <= 0:  # no prefill wait in sight, measured or predicted: nothing to smooth over
            return True
        began = self.since.get(replica_id)
        return began is not None and self.now - began >= hold_s


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """The KV blocks a prompt of ``prompt_tokens`` fills, its last one partly."""
    return -(-prompt_tokens // max(block_size, 1))


def evicted_blocks(candidate: Candidate, prompt_tokens: int, block_size: int) -> int:
    """Hot blocks a request evicts on ``candidate``: what it must compute beyond the room left
    there by the prefixes recently routed to it (0 when the room is unknown).

    The room is the lesser of the blocks not hot there (``free_blocks``) and the blocks its recent
    traffic leaves free (``kv_blocks`` less ``recent_blocks``, the room a new prefix needs in
    kvscale.router.cold_placement.fitting). A spill makes the copy its group's new home (the
    group's next requests find it there at the lower estimate), so it needs the room a new prefix
    needs; a group spilled there a moment ago has its blocks sent once, not hot yet, and counting
    hot blocks alone let groups leave a half-speed replica for replicas already full: six groups
    each on the two full-speed ones, in blocks for five prefixes, where cache_aware keeps four a
    replica and hits more (the simulated routing grid's throttled cells, docs/performance.md,
    "Routing")."""
    if candidate.free_blocks is None:
        return 0
    need = prompt_blocks(prompt_tokens, block_size) - candidate.matched_blocks
    room = candidate.free_blocks
    if candidate.kv_blocks > 0:
        room = min(room, max(candidate.kv_blocks - candidate.recent_blocks, 0))
    return max(need - room, 0)


def homes_room(candidate: Candidate, need: int) -> bool:
    """The replica's KV blocks hold one more group of ``need`` blocks beside each group homed there
    (``homed_groups``; a replica that does not say how many blocks it has, ``kv_blocks`` 0, holds
    any)."""
    return candidate.kv_blocks <= 0 or (candidate.homed_groups + 1) * need <= candidate.kv_blocks


def spill_others(anchor: Candidate, others: list[Candidate], need: int, home: str | None = None) -> list[Candidate]:
    """The replicas a group may spill to from ``anchor``, its holder: all of ``others``, except
    where the anchor's KV holds the groups homed there and this one (``need`` blocks each;
    ``home``: the replica the group was last sent to, None: unknown); then only the group's home
    and those whose KV holds one more group beside theirs (``homes_room``). A spill makes the copy
    the group's home; onto a replica whose KV its own groups fill, the group and one of them evict
    each other there at every return, a miss each time, where the queue it escaped was one wait.
    Spilled from the half-speed replica onto full-speed ones home to four groups in blocks for
    four, the groups missed there (the simulated grid's c32-p256-fits-throttled-random cell: hit
    rate 0.91 x cache_aware's over 30 streams, where cache_aware keeps four a replica;
    docs/performance.md, "Routing")."""
    groups = anchor.homed_groups + (0 if home == anchor.replica_id else 1)
    if anchor.kv_blocks <= 0 or groups * need > anchor.kv_blocks:
        return others
    return [c for c in others if c.replica_id == home or homes_room(c, need)]


def should_spill(anchor_ttft: float, other_ttft: float, saved_s: float, slack: float) -> bool:
    """The anchor is truly overloaded: its estimate beyond the other's by more than the prefill the
    hit saves, with ``slack`` (relative) for the estimates' error."""
    return anchor_ttft > (1.0 + slack) * (other_ttft + saved_s)


__all__ = ["OverloadHold", "evicted_blocks", "homes_room", "prompt_blocks", "should_spill", "spill_others"]
