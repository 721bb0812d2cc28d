"""The load figures an engine reports for the router's TTFT prediction (EngineStats.extra)."""

from __future__ import annotations

from kvscale.server.sampling_params import SamplingParams


def test_waiting_prefill_tokens_leave_out_what_the_prefix_cache_already_holds(make_engine):
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=512, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    shared = list(range(1000, 1064))  # 4 full blocks
    engine.add_request("a", shared + [7] * 16, params)
    engine.step()  # "a" is prefilled; its blocks are findable; it decodes from now on
    engine.add_request("b", shared + [9] * 16, params)  # waits (one sequence at a time): 64 tokens cached
    engine.add_request("c", list(range(2000, 2080)), params)  # waits: nothing cached
    try:
        extra = engine.get_stats().extra
    finally:
        while engine.has_unfinished_requests():
            engine.step()
    # "b" needs 80 - 64 = 16 tokens, "c" all 80: a full-prompt count (160) would make the router
    # believe this replica is twice as busy with prompts as it is.
    assert extra["prefill_tokens_waiting"] == 16 + 80
    assert extra["num_decoding"] == 1
    assert extra["max_num_batched_tokens"] == 512
    assert extra["last_step_s"] > 0


def test_the_prefill_rate_is_measured_without_a_host_tier(make_engine):
    # The autoscaler divides prefill_tokens_waiting by it (kvscale:prefill_tokens_per_s); it used
    # to be measured only for the host tier's swap-or-recompute choice, so it read 0 elsewhere.
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=512, block_size=16)
    assert engine.get_stats().extra["prefill_tokens_per_s"] == 0.0  # unmeasured
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", list(range(1000, 1096)), params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().extra["prefill_tokens_per_s"] > 0


def test_the_running_requests_are_counted_by_priority(make_engine):
    # The heartbeat's running_by_priority: what a more urgent request displaces on this replica
    # (router/band_preemption.py). The waiting one is not counted: there is nothing to displace.
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=512, block_size=16, scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for name, priority in (("low-a", 10), ("low-b", 10), ("high", 0)):
        engine.add_request(name, list(range(1000, 1032)), params, priority=priority)
    try:
        engine.step()  # the most urgent first: "high" prefills in a step of its own (urgent_prefill.py)
        assert engine.get_stats().running_by_priority == {0: 1}
        engine.step()  # then one low one is admitted beside it, the other waits
        stats = engine.get_stats()
    finally:
        while engine.has_unfinished_requests():
            engine.step()
    assert stats.running_by_priority == {0: 1, 10: 1}
    assert engine.get_stats().running_by_priority == {}
