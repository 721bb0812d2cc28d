"""Scheduling policy on a real block pool, without a model: the steps are simulated."""

from __future__ import annotations

import random

from scheduler_helpers import apply_step

from kvscale.server.core.block_pool import BlockPool
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.scheduler import Scheduler, tokens_to_schedule
from kvscale.server.core.sequence import Request, Sequence, SequenceStatus
from kvscale.server.outputs import RequestMetrics
from kvscale.server.sampling_params import SamplingParams

BS = 4


def make_seq(prompt_len: int, max_tokens: int = 4, first_token: int = 0, name: str = "r",
             group: str = "") -> Sequence:
    tokens = [first_token + i for i in range(prompt_len)]
    request = Request(name, None, tokens, SamplingParams(max_tokens=max_tokens), None,
                      RequestMetrics(0.0), max_tokens, group=group)
    seq = Sequence(request, 0, list(tokens), prompt_len)
    request.seqs.append(seq)
    return seq


def make_scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64, caching: bool = True):
    kv = KVCacheManager(BlockPool(num_blocks, BS, caching), caching)
    return Scheduler(kv, max_num_seqs, budget), kv


def simulate_step(scheduler: Scheduler, kv: KVCacheManager) -> list[Sequence]:
    """Apply one scheduled step as the engine would; returns the sequences that finished."""
    return apply_step(scheduler, kv, scheduler.schedule())


def test_tokens_to_schedule_is_capped_by_budget():
    seq = make_seq(10)
    assert tokens_to_schedule(seq, 100) == 10
    assert tokens_to_schedule(seq, 3) == 3
    seq.num_computed_tokens = 9
    assert tokens_to_schedule(seq, 100) == 1


def test_decodes_go_first_then_prefill_is_chunked():
    scheduler, kv = make_scheduler(64, budget=8)
    a = make_seq(6, name="a")
    scheduler.add(a)
    simulate_step(scheduler, kv)  # a's prefill
    b = make_seq(20, name="b")
    scheduler.add(b)
    out = scheduler.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]


def test_max_num_seqs_limits_admission():
    scheduler, kv = make_scheduler(64, max_num_seqs=2)
    seqs = [make_seq(3, name=str(i)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert list(scheduler.waiting) == [seqs[2]]


def test_preempts_newest_and_requeues_at_front():
    # 4 blocks of 4 tokens; each sequence needs 2 blocks for its prompt and a third to decode.
    scheduler, kv = make_scheduler(4, caching=False)
    old, new = make_seq(8, max_tokens=8, name="old"), make_seq(8, max_tokens=8, name="new")
    scheduler.add(old)
    scheduler.add(new)
    simulate_step(scheduler, kv)  # both prefilled: pool full
    assert kv.pool.num_free_blocks == 0
    out = scheduler.schedule()
    assert out.preempted == [new]
    assert [s.seq for s in out.scheduled] == [old]
    assert scheduler.waiting[0] is new and new.status == SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1


def test_a_single_request_is_admitted_beside_a_many_prompt_one():
    # One HTTP request's 50 prompts (one group) fill the 4 slots; a single request arrives after
    # them. When slots free, the groups take turns: it is in the next admission, not after the 50.
    scheduler, kv = make_scheduler(256, max_num_seqs=4)
    bomb = [make_seq(3, max_tokens=1, first_token=10 * i, name=f"bomb-{i}", group="bomb")
            for i in range(50)]
    for seq in bomb:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == bomb[:4]
    single = make_seq(3, max_tokens=1, first_token=999, name="single")
    scheduler.add(single)
    for seq in bomb[:4]:  # their prefill samples their one token: all four slots free
        seq.num_computed_tokens = seq.num_tokens
        scheduler.finish(seq)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == [bomb[4], single, bomb[5], bomb[6]]
    assert list(scheduler.waiting) == bomb[7:]


def test_a_preempted_sequence_resumes_before_any_group_takes_its_turn():
    # 4 blocks, 2 slots. "new" and "g2" are one HTTP request's prompts; "new" is preempted.
    scheduler, kv = make_scheduler(4, max_num_seqs=2, caching=False)
    old = make_seq(8, max_tokens=8, name="old")
    new = make_seq(8, max_tokens=8, name="new", group="g")
    g2 = make_seq(2, name="g2", group="g")
    for seq in (old, new, g2):
        scheduler.add(seq)
    simulate_step(scheduler, kv)  # old and new prefilled: pool full
    assert scheduler.schedule().preempted == [new] and new.preempted
    later = make_seq(2, name="later")
    scheduler.add(later)
    scheduler.finish(old)  # room again
    out = scheduler.schedule()
    # Resuming "new" does not use up its group's turn: "g2" (older than "later") comes next.
    assert [s.seq for s in out.scheduled] == [new, g2]
    assert not new.preempted and list(scheduler.waiting) == [later]


def test_prefix_hit_skips_cached_blocks_and_counts_tokens():
    scheduler, kv = make_scheduler(16)
    first = make_seq(10, name="first")
    scheduler.add(first)
    simulate_step(scheduler, kv)
    second = make_seq(10, name="second")  # same tokens
    scheduler.add(second)
    out = scheduler.schedule()
    item = next(s for s in out.scheduled if s.seq is second)
    # Two full blocks (8 tokens) are cached; the last 2 tokens are computed.
    assert second.num_computed_tokens == 8 and item.num_new_tokens == 2
    assert second.block_table[:2] == first.block_table[:2]
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 20


def test_prefix_being_computed_is_shared_within_the_same_step():
    scheduler, kv = make_scheduler(16, budget=64)
    first, second = make_seq(10, name="first"), make_seq(10, name="second")
    scheduler.add(first)
    scheduler.add(second)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == [first, second]
    # second reuses first's two full blocks, filled by this very step, and computes 2 tokens.
    assert second.block_table[:2] == first.block_table[:2]
    assert [s.num_new_tokens for s in out.scheduled] == [10, 2]
    assert kv.prefix_cache_hits == 8


def test_partial_chunk_registers_only_blocks_it_fills():
    scheduler, kv = make_scheduler(16, budget=6)
    first = make_seq(10, name="first")
    scheduler.add(first)
    scheduler.schedule()  # 6 tokens: one full block, one partial
    assert first.num_registered_blocks == 1
    assert kv.pool.lookup(first.block_hashes[0]) == first.block_table[0]


def test_fully_cached_prompt_recomputes_last_block():
    scheduler, kv = make_scheduler(16)
    first = make_seq(8, name="first")
    scheduler.add(first)
    simulate_step(scheduler, kv)
    second = make_seq(8, name="second")
    scheduler.add(second)
    scheduler.schedule()
    assert second.num_computed_tokens == 4, "one token must be left to compute for its logits"


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    scheduler, kv = make_scheduler(16)
    parent = make_seq(6, name="p")  # blocks: one full, one partial (2 of 4)
    scheduler.add(parent)
    simulate_step(scheduler, kv)
    child = Sequence(parent.request, 1, list(parent.token_ids[:6]), 6)
    kv.fork(parent, child)
    child.token_ids.append(9)
    scheduler.add_running(child)
    shared_partial = parent.block_table[1]
    assert kv.pool.blocks[shared_partial].ref_count == 2
    out = scheduler.schedule()
    assert {s.seq for s in out.scheduled} == {parent, child}
    copies = kv.take_pending_copies()
    assert copies == [(shared_partial, parent.block_table[1])]  # the first writer copies
    assert child.block_table[1] == shared_partial and kv.pool.blocks[shared_partial].ref_count == 1
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    scheduler.finish(parent)
    scheduler.finish(child)
    assert kv.pool.num_active_blocks == 0


def test_random_workloads_never_deadlock_or_leak():
    rng = random.Random(0)
    for trial in range(30):
        num_blocks = rng.randint(6, 20)
        scheduler, kv = make_scheduler(
            num_blocks, max_num_seqs=rng.randint(1, 6), budget=rng.randint(1, 24), caching=rng.random() < 0.7
        )
        seqs = []
        for i in range(rng.randint(1, 10)):
            max_tokens = rng.randint(1, 8)
            prompt = rng.randint(1, num_blocks * BS - max_tokens)
            seq = make_seq(prompt, max_tokens=max_tokens, first_token=rng.choice([0, 100]), name=f"{trial}-{i}")
            seqs.append(seq)
            scheduler.add(seq)
        finished = []
        for _ in range(5000):
            if not scheduler.has_unfinished():
                break
            finished += simulate_step(scheduler, kv)
        assert not scheduler.has_unfinished(), f"trial {trial} did not finish"
        assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
        assert all(s.num_output_tokens == s.request.max_tokens for s in seqs)
        assert kv.pool.num_active_blocks == 0


def test_a_running_sequence_without_room_is_left_as_it_was() -> None:
    scheduler, kv = make_scheduler(3, budget=64)
    a = make_seq(2 * BS, name="a")
    scheduler.add(a)
    simulate_step(scheduler, kv)  # a's prompt fills its two blocks, then it samples a token
    b = make_seq(BS, first_token=100, name="b")
    scheduler.add(b)
    simulate_step(scheduler, kv)  # a takes the third block, b does not fit
    assert kv.pool.num_free_blocks == 0 and len(a.block_table) == 3
    a.num_computed_tokens = 3 * BS  # a's next token needs a fourth block
    table = list(a.block_table)
    assert kv.allocate_if_room(a, 1) is False
    assert a.block_table == table and kv.take_pending_copies() == []


def test_a_forked_sequence_copies_the_shared_block_it_writes_once() -> None:
    scheduler, kv = make_scheduler(8, budget=64)
    parent = make_seq(BS + 2, name="p")
    scheduler.add(parent)
    simulate_step(scheduler, kv)
    child = Sequence(parent.request, 1, list(parent.token_ids), parent.num_prompt_tokens)
    kv.fork(parent, child)
    shared = child.block_table[1]
    assert kv.allocate_if_room(child, 1) is True
    assert child.block_table[1] != shared and kv.take_pending_copies() == [(shared, child.block_table[1])]
    assert kv.allocate_if_room(child, 1) is True and kv.take_pending_copies() == []  # private now


def test_a_step_holds_at_most_max_loras_adapters():
    """The device holds --max-loras adapters (docs/server.md, "LoRA adapters"): a waiting request
    of another adapter waits until one of the batch's adapters has left it, while base requests
    and requests of adapters already in the batch go ahead of it."""
    kv = KVCacheManager(BlockPool(64, BS, True), True)
    scheduler = Scheduler(kv, 8, 64, max_loras=2)
    seqs = {}
    for i, adapter in enumerate(["a1", "a2", "a3", None, "a1"]):
        seq = make_seq(4, max_tokens=2 if adapter == "a1" else 8, first_token=100 * i, name=f"r{i}")
        seq.request.lora_name = adapter
        seqs[i] = seq
        scheduler.add(seq)
    simulate_step(scheduler, kv)
    running = {seq.request.request_id for seq in scheduler.running}
    assert running == {"r0", "r1", "r3", "r4"}, running
    assert [seq.request.request_id for seq in scheduler.waiting] == ["r2"]
    # a1's requests end after two tokens: a slot for a3 frees.
    for _ in range(3):
        simulate_step(scheduler, kv)
    assert "r2" in {seq.request.request_id for seq in scheduler.running}
    adapters = {seq.request.lora_name for seq in scheduler.running} - {None}
    assert adapters == {"a2", "a3"}, adapters
