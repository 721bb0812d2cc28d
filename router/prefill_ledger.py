"""This router's own in-flight token accounting per replica, corrected when a heartbeat catches up.

A replica's heartbeat says how many prompt tokens wait for prefill there, but it is up to a second
old. Between heartbeats this router knows what it sent since (not in the heartbeat yet) and which
of the requests the heartbeat counted have started streaming since (their prefill is done, so the
heartbeat over-counts them). ``queued_prefill_tokens`` combines the two; a pure function.

The heartbeat also counts a shared prefix once per waiting request: the engine takes off a waiting
prompt only the blocks cached now, so while a group's first request waits to be admitted, every
sibling queued behind it counts the group's prefix again, although the engine computes it once
(the siblings find its blocks once it is scheduled). The holder of a group whose requests arrive
together then looks overloaded exactly when they do. This router knows each request it sent
there (its prompt's block hashes) and which blocks the replica confirmed (its KV events);
``shared_prefix_tokens`` is what the heartbeat counted more than once, and is taken off it (a
pure function too): a later request of a group adds only what it does not share.

Only the router's event loop touches a ledger, so it has no locks.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from kvscale.kv_index_schema import Heartbeat

# Prefill waits remembered per replica: a minute of a slow replica's requests.
RECENT_WAITS = 16


@dataclass
class Sent:
    tokens: int  # prompt tokens the replica must compute for it (prompt minus predicted hit)
    sent_at: float  # this router's monotonic clock, as is the heartbeat's time it is compared with
    started_at: float | None = None  # its first response byte: prefill done
    finished_at: float | None = None  # its end (it no longer decodes)
    hashes: Sequence[int] = ()  # its prompt's full block hashes, in order (prefix policies; else none)
    prompt_tokens: int = 0  # its prompt's length (0: not told)


def leading_run(limit: int, shared_at: Callable[[int], bool]) -> int:
    """The longest run of leading blocks, at most ``limit``, for which ``shared_at(position)``
    holds. Block hashes are chained (a block's hash covers every token before it), so a block
    shared at one position means every block before it is shared too: a binary search, where a
    prompt of a few thousand tokens is hundreds of blocks."""
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if shared_at(mid - 1):
            low = mid
        else:
            high = mid - 1
    return low


def common_prefix(hashes: Sequence[int], other: Sequence[int], limit: int) -> int:
    """Leading blocks, at most ``limit``, that two prompts share."""
    return leading_run(min(len(hashes), len(other), limit), lambda i: hashes[i] == other[i])


def shared_with_any(hashes: Sequence[int], blocks: AbstractSet[int], limit: int) -> int:
    """Leading blocks, at most ``limit``, of ``hashes`` among ``blocks`` (the union of other
    prompts' blocks): the longest prefix shared with any of them."""
    return leading_run(min(len(hashes), limit), lambda i: hashes[i] in blocks)


def cached_run(hashes: Sequence[int], confirmed: Container[int]) -> int:
    """Leading blocks of ``hashes`` in ``confirmed`` (a replica's own report: walked block by block,
    as the engine looks its cache up)."""
    n = 0
    for block in hashes:
        if block not in confirmed:
            break
        n += 1
    return n


def shared_prefix_tokens(
    heartbeat_waiting: int, heartbeat_time: float, sent: Iterable[Sent], block_size: int,
    confirmed: Container[int] = frozenset(),
) -> int:
    """Prompt tokens a heartbeat counted more than once: the blocks each waiting request of ours
    shares with an earlier one of ours waiting there too, beyond those cached then.

    The engine counts a waiting prompt less its leading blocks cached now, and a block becomes
    findable once a step that computes it is scheduled: while a group's first request waits, every
    sibling behind it counts the prefix again, although only the first computes it. Which of ours
    were waiting: the heartbeat's ``heartbeat_waiting`` latest of those it counted (sent before it,
    not started by then; FCFS admits in order). Cached then, as far as this router can tell: the
    leading blocks the replica confirmed (``confirmed``: its KV events, in the prefix index), and
    those of our requests there that were admitted or had started by then.
    """
    sent = list(sent)
    counted = [s for s in sent if s.sent_at <= heartbeat_time
               and (s.started_at is None or s.started_at > heartbeat_time)]
    counted.sort(key=lambda s: s.sent_at)  # stable: sends of one instant keep their order
    k = min(max(heartbeat_waiting, 0), len(counted))
    if k < 2:
        return 0
    waiting = counted[len(counted) - k:]
    # Only prompts that begin alike share a block: groups by first block, of two or more.
    groups: dict[int, list[Sent]] = {}
    for s in waiting:
        if s.hashes:
            groups.setdefault(s.hashes[0], []).append(s)
    groups = {first: members for first, members in groups.items() if len(members) > 1}
    if not groups:
        return 0
    waiting_ids = {id(s) for s in waiting}
    held: dict[int, list[Sequence[int]]] = {}  # our prompts the engine held then: admitted or started
    for s in sent:
        if s.hashes and s.hashes[0] in groups and s.sent_at <= heartbeat_time and id(s) not in waiting_ids:
            held.setdefault(s.hashes[0], []).append(s.hashes)
    size = max(block_size, 1)
    twice = 0
    for first, members in groups.items():
        ahead = set(members[0].hashes)  # the blocks of the group's waiting requests so far
        cached_runs: dict[int, int] = {}  # a shared prefix (by its last block) -> its leading blocks cached
        for s in members[1:]:
            # The engine never takes a prompt's last token from the cache.
            limit = max(s.prompt_tokens - 1, 0) // size if s.prompt_tokens else len(s.hashes)
            shared = shared_with_any(s.hashes, ahead, limit)
            ahead.update(s.hashes[shared:])
            if shared == 0:
                continue
            last = s.hashes[shared - 1]
            cached = cached_runs.get(last)
            if cached is None:
                by_ours = max((common_prefix(s.hashes, h, shared) for h in held.get(first, ())), default=0)
                cached = cached_runs[last] = by_ours + cached_run(s.hashes[by_ours:shared], confirmed)
            twice += (shared - cached) * size
    return twice


def queued_prefill_tokens(
    heartbeat_tokens: int | None, heartbeat_time: float, sent: Iterable[Sent], shared: int = 0
) -> int:
    """Prompt tokens waiting for prefill on one replica, as best this router can tell.

    heartbeat's figure
      - tokens it counted more than once (``shared``: ``shared_prefix_tokens``)
      - tokens of our requests it counted (sent before it) that have started since
      + tokens of our requests sent after it that have not started.
    Without a heartbeat, our own unstarted requests are all we know (each counted less its
    predicted hit: a sibling sent behind its group's first counts its suffix only).
    """
    unstarted_after = started_since = unstarted = 0
    for s in sent:
        if s.started_at is None:
            unstarted += s.tokens
            if s.sent_at > heartbeat_time:
                unstarted_after += s.tokens
        elif s.sent_at <= heartbeat_time < s.started_at:
            started_since += s.tokens
    if heartbeat_tokens is None:
        return unstarted
    return max(0, heartbeat_tokens - shared - started_since) + unstarted_after


def waiting_prefill(
    heartbeat_tokens: int | None, heartbeat_waiting: int, heartbeat_time: float, sent: Iterable[Sent],
    block_size: int, confirmed: Container[int] = frozenset(),
) -> int:
    """``queued_prefill_tokens`` with the heartbeat's repeats of shared prefixes taken off
    (``shared_prefix_tokens``): the uncached tokens of a prefix count once per replica."""
    sent = list(sent)
    if heartbeat_tokens is None:
        return queued_prefill_tokens(None, heartbeat_time, sent)
    shared = shared_prefix_tokens(heartbeat_waiting, heartbeat_time, sent, block_size, confirmed)
    return queued_prefill_tokens(heartbeat_tokens, heartbeat_time, sent, shared)


def decoding_count(
    heartbeat_decoding: int | None, heartbeat_time: float, sent: Iterable[Sent]
) -> int:
    """Sequences decoding on one replica: the heartbeat's count, less our requests that finished
    since it, plus ours that started since it. Without a heartbeat, ours that are decoding."""
    return corrected_count(heartbeat_decoding, heartbeat_time, sent, lambda s: s.started_at)


def sequences_ahead(
    heartbeat_seqs: int | None, heartbeat_time: float, sent: Iterable[Sent]
) -> int:
    """Sequences a request sent now finds ahead of it on one replica (running and waiting): the
    heartbeat's count, less our requests that finished since it, plus ours sent after it still
    open. Without a heartbeat, our own open requests."""
    return corrected_count(heartbeat_seqs, heartbeat_time, sent, lambda s: s.sent_at)


def corrected_count(
    heartbeat_count: int | None, heartbeat_time: float, sent: Iterable[Sent],
    began: Callable[[Sent], float | None],
) -> int:
    """A heartbeat's count of our requests' kind (``began``: when one joined it, None: not yet),
    less those that left it since the heartbeat, plus those that joined since; without a
    heartbeat, ours in it now."""
    joined_since = left_since = in_now = 0
    for s in sent:
        joined = began(s)
        if joined is None:
            continue
        if s.finished_at is None:
            in_now += 1
            if joined > heartbeat_time:
                joined_since += 1
        elif joined <= heartbeat_time < s.finished_at:
            left_since += 1
    if heartbeat_count is None:
        return in_now
    return max(0, heartbeat_count - left_since) + joined_since


def decode_left(sent: Iterable[Sent], typical_decode_s: float, now: float) -> tuple[float, ...]:
    """Seconds of decoding left of our open requests on one replica, soonest first: each expected
    to decode ``typical_decode_s`` (this router's recent first byte to end there) from its first
    byte, less what it has decoded so far (0 once past it: it may end any step). A request not
    started yet has it all ahead. Empty when nothing has finished yet (no typical length known)."""
    if typical_decode_s <= 0:
        return ()
    left = [typical_decode_s - (now - s.started_at if s.started_at is not None else 0.0)
            for s in sent if s.finished_at is None]
    return tuple(sorted(max(x, 0.0) for x in left))


class PrefillLedger:
    """Requests this router sent to one replica, by a key of the caller's choosing.

    A finished request stays a little while (``keep_s``): a heartbeat taken before it started
    still counts its prompt as waiting, and only this entry can take it off again.
    """

    def __init__(self, keep_s: float = 5.0) -> None:
        self.open: dict[int, Sent] = {}
        self.keep_s = keep_s
        self._finished: dict[int, Sent] = {}
        # The last few prefill waits (sent to first byte): how long a prediction must live here.
        self._waits: deque[float] = deque(maxlen=RECENT_WAITS)
        # The last few decodes (first byte to end): how long a sequence holds a batch slot here.
        self._decodes: deque[float] = deque(maxlen=RECENT_WAITS)

    def sent(self, key: int, tokens: int, now: float, hashes: Sequence[int] = (), prompt_tokens: int = 0) -> None:
        """``tokens``: what the replica must compute for it; ``hashes``: its prompt's full blocks."""
        self.open[key] = Sent(tokens, now, hashes=hashes, prompt_tokens=prompt_tokens)

    def started(self, key: int, now: float) -> None:
        entry = self.open.get(key)
        if entry is not None and entry.started_at is None:
            entry.started_at = now
            self._waits.append(now - entry.sent_at)

    def prefill_wait(self, now: float) -> float:
        """The longest of: the oldest open request's wait for its first byte so far, and the
        last RECENT_WAITS requests' waits (the index stretches its predictions to it)."""
        waiting = max((now - s.sent_at for s in self.open.values() if s.started_at is None), default=0.0)
        return max(waiting, max(self._waits, default=0.0))

    def done(self, key: int, now: float) -> None:
        entry = self.open.pop(key, None)
        if entry is not None and entry.started_at is not None:
            entry.finished_at = now
            self._finished[key] = entry
            self._decodes.append(now - entry.started_at)

    def typical_decode_s(self) -> float:
        """The median of the last RECENT_WAITS decodes here (first byte to end); 0: none yet."""
        if not self._decodes:
            return 0.0
        return statistics.median(self._decodes)

    def entries(self, now: float) -> list[Sent]:
        """Open requests, and finished ones recent enough that a heartbeat may still count them."""
        cutoff = now - self.keep_s
        stale = [k for k, s in self._finished.items()
                 if s.finished_at is not None and s.finished_at < cutoff]
        for key in stale:
            del self._finished[key]
        return [*self.open.values(), *self._finished.values()]


def ttft_inputs(
    heartbeat: Heartbeat | None, ledger: PrefillLedger | None, now: float, heartbeat_time: float,
    confirmed: Container[int] = frozenset(), fleet_decode_s: float = 0.0,
) -> dict[str, Any]:
    """The predicted-ttft fields of a policy Candidate, from a replica's heartbeat (or None) and
    this router's ledger for it (or None). ``now`` and ``heartbeat_time`` (when the heartbeat was
    taken) are on the ledger's clock, this router's monotonic one; ``confirmed``: the blocks the
    replica reported holding (the prefix index's); ``fleet_decode_s``: the typical decode over the
    fleet, for a replica where none of ours has finished yet."""
    sent = ledger.entries(now) if ledger is not None else []
    if heartbeat is None:
        return {"queued_prefill_tokens": queued_prefill_tokens(None, 0.0, sent),
                "num_decoding": decoding_count(None, 0.0, sent)}
    typical = (ledger.typical_decode_s() if ledger is not None else 0.0) or fleet_decode_s
    return {
        "batch_slots": heartbeat.max_num_seqs,
        "sequences_ahead": sequences_ahead(heartbeat.load, heartbeat_time, sent),
        "decode_left_s": decode_left(sent, typical, now),
        "queued_prefill_tokens": waiting_prefill(
            heartbeat.prefill_tokens_waiting, heartbeat.num_waiting, heartbeat_time, sent, heartbeat.block_size,
            confirmed),
        "num_decoding": decoding_count(heartbeat.num_decoding, heartbeat_time, sent),
        "prefill_tokens_per_s": heartbeat.prefill_tokens_per_s,
        "decode_step_s": heartbeat.decode_step_s,
        "step_token_budget": heartbeat.step_token_budget,
    }
