"""The order in which the scheduler tries waiting sequences, as a pure function: fair across
the tenants they came from, and within a tenant across the HTTP requests.

Every engine request carries a group: the HTTP request it came from (a multi-prompt request's
prompts and one prompt's n samples share one). Admission takes the groups round-robin, the
oldest waiting sequence of each group in turn, groups ordered by their oldest waiting sequence,
so one request with thousands of prompts cannot take every free slot and the whole token budget
while a single-prompt request that arrived after it waits for all of them (docs/engine.md,
"A step"). With one sequence per group this is first come, first served, as before.

Every engine request also carries a tenant: the one the router named, trusted only from the
router ("" for none; docs/server.md, "Tenants"). Above the groups, the tenants share the batch:
each next sequence comes from the tenant holding the fewest sequences (those running plus those
this pass has put before it), the tenant with the oldest waiting sequence first among equals.
So a tenant with many requests running cannot take a freed slot from one with few, and a burst
queued at once is interleaved with everyone else's. Shares are equal: a tenant's weight is not
used here. With one tenant (every request without the header) the order is the groups' alone.

Sequences that were preempted come first, in queue order, before any tenant's turn: they had
been admitted already, and letting newcomers take the blocks they just gave up would only
preempt again (docs/engine.md, "A step").
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence


def admission_order(groups: Sequence[Hashable], num_resuming: int = 0,
                    tenants: Sequence[str] | None = None,
                    running: Mapping[str, int] | None = None) -> Iterator[int]:
    """Indices into the waiting queue, in the order admission tries them.

    ``groups``: each waiting sequence's group, in queue order (arrival order, the preempted at
    the front). ``num_resuming``: how many at the front were preempted; they go first as they
    are. ``tenants``: each waiting sequence's tenant, in the same order (None: one tenant for
    all). ``running``: how many sequences each tenant has running (absent: none). Lazy:
    admission stops at the first sequence that does not fit, usually early, so only the grouping
    pass costs the whole queue.
    """
    yield from range(num_resuming)
    rest = range(num_resuming, len(groups))
    if tenants is None:
        yield from _round_robin(rest, groups)
        return
    by_tenant: dict[str, list[int]] = {}
    for index in rest:
        by_tenant.setdefault(tenants[index], []).append(index)
    held = running or {}
    # (sequences held, oldest waiting index, the tenant's own order): the oldest index is unique,
    # so the orders themselves are never compared.
    heap = [(held.get(tenant, 0), indices[0], _round_robin(indices, groups))
            for tenant, indices in by_tenant.items()]
    heapq.heapify(heap)
    while heap:
        count, oldest, order = heap[0]
        turn = next(order, None)
        if turn is None:
            heapq.heappop(heap)
            continue
        yield turn
        heapq.heapreplace(heap, (count + 1, oldest, order))


def _round_robin(indices: Iterable[int], keys: Sequence[Hashable]) -> Iterator[int]:
    """``indices`` taken round-robin by ``keys[index]``, the keys ordered by their first index,
    each key's indices in order."""
    # A dict keeps insertion order: the groups come out ordered by their oldest sequence.
    by_key: dict[Hashable, list[int]] = {}
    for index in indices:
        by_key.setdefault(keys[index], []).append(index)
    members = list(by_key.values())
    turn = 0
    while members:
        # One round: each group still waiting gives its next sequence; emptied groups drop out.
        still = []
        for member in members:
            yield member[turn]
            if turn + 1 < len(member):
                still.append(member)
        members = still
        turn += 1
