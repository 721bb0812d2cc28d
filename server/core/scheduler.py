"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Policy (one step):
  1. Running sequences first, oldest first: a decode takes one token (after a grammar
     fast-forward, also the forced run appended behind it), an unfinished prefill takes what is
     left of it (chunked to the remaining token budget).
     When blocks run out, the newest running sequence is preempted (its blocks are freed and it
     goes back to the front of the queue), repeatedly, until the current one fits or is itself
     the newest. With a host tier a victim whose swap is cheaper than its recompute (measured
     copy and prefill rates, kv_tier_policy.swap_is_cheaper) has its full blocks demoted at
     once, and resumes by promoting them; otherwise it is recomputed.
  2. Then, unless something was preempted this step, waiting sequences while the token budget
     and ``max_num_seqs`` allow; the last one admitted may be a partial chunk. They are tried
     preempted first, then the tenant holding the fewest running first, and round-robin
     across the HTTP requests they came from (admission_order.py), so neither one tenant's
     burst nor one many-prompt request can fill the batch ahead of requests that arrived after
     it. A waiting sequence that does not fit stops admission (no later one
     overtakes it).
Under ``--scheduling-policy priority`` (priority_order.py) the running sequences are kept in
(priority, arrival) order, the preemption victim is the one with the largest key rather than the
newest, and waiting sequences are tried by priority level first, the fcfs order within a level.
Before step 1 there, a waiting sequence that lacks a slot or blocks preempts a running one of a
strictly larger priority value (arrival_preemption.py), so a more urgent arrival does not wait
for a less urgent request to end. And while a prefill strictly more urgent than some running
or waiting sequence is pending, step 1 stops at the first less urgent one and step 2 admits none of
them: when the urgent prefill is in the step, they skip it (urgent_prefill.py, bounded), so its
first token does not wait for their rows; when it is not, the step goes on as without that.
Blocks become findable by hash when they are scheduled, not when they are computed, so requests
arriving together with a common prefix compute it once (see KVCacheManager.register_full_blocks).
Admission control guarantees any single sequence fits the whole pool, so the oldest running
sequence can always progress: no deadlock.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvscale.server.config import SCHEDULING_POLICIES
from kvscale.server.core.admission_order import admission_order
from kvscale.server.core.arrival_preemption import arrival_victim, lacks_room
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.kv_tier_policy import (
    blocks_to_demote_ahead,
    swap_is_cheaper,
    watermark_blocks,
)
from kvscale.server.core.priority_order import preemption_victim, priority_admission_order
from kvscale.server.core.sequence import Sequence, SequenceStatus
from kvscale.server.core.step_rates import StepRates
from kvscale.server.core.urgent_prefill import skips, urgent_level


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _priority_key(seq: Sequence) -> tuple[int, int]:
    """(priority, arrival): a sequence's ids are handed out as sequences reach the engine."""
    return seq.request.priority, seq.seq_id


def tokens_to_schedule(seq: Sequence, budget: int, num_computed: int | None = None) -> int:
    """Tokens of ``seq`` to run now: all that are not computed yet, cut to the token budget."""
    computed = seq.num_computed_tokens if num_computed is None else num_computed
    return max(min(seq.num_tokens - computed, budget), 0)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 0, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {policy!r}")
        self.kv = kv
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # LoRA adapters one step may carry, the device's slots (--max-loras; 0: LoRA off).
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions whose blocks went down to the host tier
        # What the swap-or-recompute choice reads; the engine keeps them up to date.
        self.block_bytes = 0
        self.copy_bytes_per_s = 0.0
        self.step_rates = StepRates()
        self.watermark = watermark_blocks(kv.pool.num_blocks) if kv.pool.host is not None else 0
        # Steps in a row that a less urgent waiting sequence was held out of (urgent_prefill.py).
        self.waiting_held_steps = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins the batch directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        priority = self.policy == "priority"
        if priority:
            # Most urgent first: the victim, the largest key, is then always at the end, never a
            # sequence this step already scheduled (whose blocks were registered by hash before
            # their KV is computed: freeing them now would publish empty blocks).
            self.running.sort(key=_priority_key)

        if priority and self.waiting and self.running:
            self._preempt_for_arrivals(out)
        level = self._urgent_level() if priority else None
        budget, growth_preempted, i = self._schedule_running(out, budget, 0, level)
        if level is not None:
            if self._urgent_step(out, budget, growth_preempted, level):
                held = any(seq.request.priority > level for seq in self.waiting)
                self.waiting_held_steps = self.waiting_held_steps + 1 if held else 0
                self._demote_ahead()
                return out
            # No prefill of the level could run: the less urgent ones run after all.
            budget, more, _ = self._schedule_running(out, budget, i, None)
            growth_preempted = growth_preempted or more

        self.waiting_held_steps = 0
        if growth_preempted:
            self._demote_ahead()
            return out
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            self._admit(out, budget)
        self._demote_ahead()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, start: int,
                          level: int | None) -> tuple[int, bool, int]:
        """Step 1 from ``running[start]`` on, stopping at the first sequence that skips for
        ``level`` (urgent_prefill.py; the list is sorted, so the rest skip too). Returns the
        budget left, whether a growth preempted anything, and where it stopped."""
        kv = self.kv
        priority = self.policy == "priority"
        growth_preempted = False
        i = start
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if level is not None and seq.request.priority > level:
                break  # skips(seq.request.priority, level), inlined: fcfs pays one test per sequence
            num_new = tokens_to_schedule(seq, budget)
            while not kv.allocate_if_room(seq, num_new):
                victim = self.running.pop(
                    preemption_victim([_priority_key(s) for s in self.running]) if priority else -1)
                self._preempt(victim)
                out.preempted.append(victim)
                growth_preempted = True
                if victim is seq:
                    break
            else:
                kv.register_full_blocks(seq, seq.num_computed_tokens + num_new)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                seq.skipped_steps = 0
                budget -= num_new
                i += 1
                continue
            break  # the current sequence preempted itself: it was the newest
        return budget, growth_preempted, i

    def _urgent_level(self) -> int | None:
        return urgent_level([(seq.request.priority, seq.num_computed_tokens < seq.num_prompt_tokens,
                              seq.skipped_steps) for seq in self.running],
                            (seq.request.priority for seq in self.waiting), self.waiting_held_steps)

    def _urgent_step(self, out: SchedulerOutput, budget: int, growth_preempted: bool, level: int) -> bool:
        """With the running sequences down to ``level`` scheduled, the waiting ones down to it
        admitted; True when a prefill of the level is in the step, which the less urgent running
        sequences then skip (urgent_prefill.py). Nothing was admitted when it returns False."""
        first_admitted = len(out.scheduled)
        if not growth_preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            self._admit(out, budget, max_priority=level)
        # Only the level's sequences can be prefills down to it: it is the most urgent pending.
        if not any(item.seq.request.priority <= level
                   and (k >= first_admitted or item.seq.num_computed_tokens < item.seq.num_prompt_tokens)
                   for k, item in enumerate(out.scheduled)):
            return False
        for seq in self.running:
            if skips(seq.request.priority, level):
                seq.skipped_steps += 1
        return True

    def _admit(self, out: SchedulerOutput, budget: int, max_priority: int | None = None) -> None:
        """Waiting sequences into the batch, in admission_order, while budget and slots last
        (under priority, none of a larger value than ``max_priority``)."""
        kv = self.kv
        waiting = list(self.waiting)
        if not waiting:
            return
        num_resuming = 0
        while num_resuming < len(waiting) and waiting[num_resuming].preempted:
            num_resuming += 1
        admitted = 0
        running = Counter(seq.request.tenant for seq in self.running)
        adapters = {seq.request.lora_name for seq in self.running} - {None}
        groups = [seq.request.group for seq in waiting]
        tenants = [seq.request.tenant for seq in waiting]
        order = (priority_admission_order([seq.request.priority for seq in waiting], groups,
                                          num_resuming, tenants, running)
                 if self.policy == "priority" else admission_order(groups, num_resuming, tenants, running))
        for index in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            seq = waiting[index]
            if max_priority is not None and seq.request.priority > max_priority:
                break  # the levels ascend: none after it is more urgent
            adapter = seq.request.lora_name
            if adapter is not None and adapter not in adapters and len(adapters) >= self.max_loras:
                # Every device slot serves an adapter of this batch: this one waits for a slot,
                # while requests of those adapters and base ones go ahead (docs/server.md,
                # "LoRA adapters").
                continue
            cached = kv.find_cached_prefix(seq) if not seq.block_table else []
            num_computed = len(cached) * kv.block_size if cached else seq.num_computed_tokens
            num_new = tokens_to_schedule(seq, budget, num_computed)
            if not kv.can_allocate(seq, num_new, cached):
                break
            kv.record_lookup(seq, num_computed, cached)
            kv.allocate(seq, num_new, cached)
            kv.register_full_blocks(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            seq.preempted = False
            self.running.append(seq)
            if adapter is not None:
                adapters.add(adapter)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            admitted += 1
        if admitted:  # the rest keep their order
            self.waiting.clear()
            self.waiting.extend(seq for seq in waiting if seq.status == SequenceStatus.WAITING)

    def _preempt_for_arrivals(self, out: SchedulerOutput) -> None:
        """Waiting sequences, in admission order, each preempting running ones of a strictly larger
        priority value while it lacks a slot or blocks (arrival_preemption.py). Done before the
        running sequences are scheduled: a victim's blocks then hold only computed KV (a block is
        findable by hash from the step that schedules it). The room counted is what is left after
        the running sequences' growth this step and the earlier waiting ones' needs; admission
        then takes the waiting ones in the same order."""
        most_urgent = min(seq.request.priority for seq in self.waiting)
        if most_urgent >= max(seq.request.priority for seq in self.running):
            return  # the common case: nothing waiting is more urgent than what runs
        kv = self.kv
        budget = self.max_num_batched_tokens
        growth: dict[int, tuple[int, int]] = {}  # seq_id -> (tokens, blocks) it takes this step
        for seq in self.running:  # sorted by key, as the running loop takes them
            num_new = tokens_to_schedule(seq, budget)
            budget -= num_new
            growth[seq.seq_id] = (num_new, kv.num_blocks_needed(seq, num_new) if num_new else 0)
        waiting = list(self.waiting)
        num_resuming = 0
        while num_resuming < len(waiting) and waiting[num_resuming].preempted:
            num_resuming += 1
        order = priority_admission_order([seq.request.priority for seq in waiting],
                                         [seq.request.group for seq in waiting], num_resuming,
                                         [seq.request.tenant for seq in waiting],
                                         Counter(seq.request.tenant for seq in self.running))
        slots = self.max_num_seqs - len(self.running)
        reserved = sum(blocks for _, blocks in growth.values())
        adapters = {seq.request.lora_name for seq in self.running} - {None}
        for index in order:
            seq = waiting[index]
            if (budget <= 0 or not self.running
                    or seq.request.priority >= max(s.request.priority for s in self.running)):
                return  # no victim for this one, nor for any after it (the levels ascend)
            adapter = seq.request.lora_name
            if adapter is not None and adapter not in adapters and len(adapters) >= self.max_loras:
                continue  # admission passes it over too: preempting for it would only thrash
            while True:
                cached = kv.find_cached_prefix(seq) if not seq.block_table else []
                num_computed = len(cached) * kv.block_size if cached else seq.num_computed_tokens
                num_new = tokens_to_schedule(seq, budget, num_computed)
                needed = kv.num_blocks_needed(seq, num_new, cached)
                if not lacks_room(slots, kv.pool.num_free_blocks - reserved, needed):
                    break
                at = arrival_victim(seq.request.priority, [_priority_key(s) for s in self.running])
                if at is None:
                    return  # admission stops at this one too: nothing after it is tried
                victim = self.running.pop(at)
                tokens, blocks = growth.pop(victim.seq_id, (0, 0))
                budget += tokens
                reserved -= blocks
                self._preempt(victim)
                out.preempted.append(victim)
                slots += 1
            slots -= 1
            reserved += needed
            budget -= num_new

    def _demote_ahead(self) -> None:
        """Write-back at the watermark: keep some fresh tier-1 blocks by demoting LRU cached ones."""
        pool = self.kv.pool
        if self.watermark:
            pool.demote_ahead(
                blocks_to_demote_ahead(pool.num_fresh_blocks, pool.num_cached_free_blocks, self.watermark)
            )

    def _preempt(self, seq: Sequence) -> None:
        swap = self.kv.pool.host is not None and swap_is_cheaper(
            seq.num_registered_blocks, self.block_bytes, seq.num_computed_tokens,
            self.copy_bytes_per_s, self.step_rates.prefill_tokens_per_s,
        )
        self.num_swapped_out += swap
        self.kv.free(seq, swap_out=swap)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.preempted = True  # resumes before any group's turn (admission_order.py)
        seq.skipped_steps = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq)
