"""The hit-rate bounds of bench/w3_policy_sim.py: the arithmetic ceiling and the oracle policy."""

from __future__ import annotations

import pytest

from bench.w3_ceilings import hit_ceiling
from bench.w3_hit_bound import TARGETS, against_round_robin
from bench.w3_sim import Costs
from bench.w3_sim_router import ORACLE
from bench.w3_sim_run import simulate_run
from bench.w3_workloads import Workload, build_workload

W3 = dict(groups=8, prefix_tokens=128, suffix_tokens=16, requests=64, output_tokens=4, concurrency=8, seed=0)
SIM = dict(replicas=4, num_blocks=48, block_size=16, costs=Costs(46.0, 0.55, 2048, 8))


def test_the_ceiling_is_every_request_but_each_groups_first_reusing_all_but_its_last_token():
    workload = build_workload("w3", W3, 0)
    # 56 of 64 requests reuse their 128-token prefix (8 whole blocks) out of 144 prompt tokens.
    assert hit_ceiling(workload, 16) == pytest.approx((64 - 8) / 64 * 128 / 144)


def test_the_ceiling_counts_a_follow_up_turns_earlier_prompt_and_answer():
    prompt = list(range(40))
    answer = list(range(100, 110))
    turns = [(0.0, prompt, answer, 10), (0.0, prompt + answer + [7, 8], [], 1)]
    # The second prompt (52 tokens) can reuse 3 full blocks of 16: the first prompt's 40 tokens and 8 of
    # the answer's (its last token is always computed, so no fourth block).
    assert hit_ceiling(Workload([turns]), 16) == pytest.approx(48 / (40 + 52))


def test_no_policy_beats_the_ceiling_and_the_oracle_reaches_it_when_every_prefix_fits():
    workload = build_workload("w3", W3, 0)
    ceiling = hit_ceiling(workload, 16)
    for policy in (ORACLE, "predicted-ttft", "round-robin"):
        assert simulate_run(workload, policy, **SIM)["hit_rate"] <= ceiling + 1e-9
    # Here each replica's share of the 8 prefixes (8 blocks each) fits its 48-block pool, so a group
    # misses only once under the oracle.
    assert simulate_run(workload, ORACLE, **SIM)["hit_rate"] == pytest.approx(ceiling)


def test_the_oracle_ignores_load():
    # One group only: every request holds the same prefix, so the oracle sends all of them to one replica.
    workload = build_workload("w3", dict(W3, groups=1), 0)
    result = simulate_run(workload, ORACLE, **SIM)
    assert result["max_over_mean_requests"] == pytest.approx(4.0)


def test_ratios_against_round_robin_read_the_targets_direction():
    rr = {"hit_rate": 0.3, "ttft_p50_s": 3.0, "ttft_p90_s": 6.0, "output_tokens_per_s": 5.0, "max_over_mean_requests": 1.0}
    row = {"hit_rate": 0.9, "ttft_p50_s": 1.0, "ttft_p90_s": 4.0, "output_tokens_per_s": 7.5, "max_over_mean_requests": 1.2}
    ratios = against_round_robin(row, rr)
    assert ratios == pytest.approx({"hit_rate_ratio": 3.0, "ttft_p50_better": 3.0, "ttft_p90_better": 1.5,
                                    "throughput_ratio": 1.5, "max_over_mean_requests": 1.2})
    assert set(ratios) == set(TARGETS)


def test_the_simulated_index_forgets_a_block_the_replica_stored_then_evicted():
    """As the real index (kvscale.router.index): a prediction lasts until the replica reports the
    block stored; evicted after that, the block no longer matches. (The simulator kept predictions
    for their whole 10 s, so on pools too small for the prefixes it anchored requests on replicas
    that had evicted them.)"""
    from bench.w3_sim import SimReplica, SimRequest
    from bench.w3_sim_router import SimRouter

    replica = SimReplica(0, num_blocks=4, block_size=16, costs=Costs(1000.0, 0.01, 2048, 8))
    router = SimRouter("predicted-ttft", [replica], 16, seed=0)
    replica.on_stored = router.stored
    first = SimRequest(0, 0.0, [1, 2, 3], 48, 1)
    replica.waiting.append(first)
    router.route(first, 0.0)
    assert router.matched(replica, [1, 2, 3], 0.1) == 3  # predicted: not computed yet
    replica.step(0.1)  # scheduled: stored, and the prediction gives way to the cache
    assert router.predicted[0] == {}
    while replica.running:
        replica.step(1.0)
    other = SimRequest(1, 2.0, [7, 8, 9, 10], 64, 1)
    replica.waiting.append(other)
    replica.step(2.0)  # its 4 blocks evict 1, 2 and 3 from the 4-block pool
    assert router.matched(replica, [1, 2, 3], 2.5) == 0


def test_a_replica_read_as_a_real_one_counts_a_prefill_until_its_step_ends():
    """A real replica's heartbeat is the engine's stats taken after each step
    (server/engine/core_loop.py, server/engine/engine_stats.py): a prefill being computed counts
    in full until the step that computes it ends, and its KV events arrive then too. (The
    simulator took it off the router's view as the step began.)"""
    from bench.w3_sim import SimReplica, SimRequest
    from bench.w3_sim_router import SimRouter

    replica = SimReplica(0, num_blocks=16, block_size=16, costs=Costs(100.0, 0.01, 64, 8))
    replica.heartbeat_queue = True
    router = SimRouter("predicted-ttft", [replica], 16, seed=0)
    replica.on_stored = router.stored
    request = SimRequest(0, 0.0, list(range(1, 9)), 128, 1)  # 128 tokens: two 64-token steps
    replica.waiting.append(request)
    end, _, _ = replica.step(0.0)
    assert router.queued(replica, end / 2) == 128  # no heartbeat yet: the router's own send
    replica.publish(end)
    assert router.queued(replica, end) == 64  # the first step's half done
    second, firsts, _ = replica.step(end)
    assert firsts == [request] and replica.announced == set()  # computed as the step ends, not before
    assert router.queued(replica, (end + second) / 2) == 64  # still the heartbeat of the first step's end
    replica.publish(second)
    assert router.queued(replica, second) == 0 and replica.announced == set(range(1, 9))


def test_a_replica_read_as_a_real_one_evicts_a_prefix_tail_first():
    """The engine frees a request's blocks tail first (server/core/kv_cache_manager.py ``free``), so
    its LRU takes a prefix's last blocks before its leading ones, and a later request still finds
    the leading part. (The simulator evicted by admission order, leading block first: a prefix's
    chained hashes then matched nothing at all.)"""
    from bench.w3_sim import SimReplica, SimRequest

    replica = SimReplica(0, num_blocks=6, block_size=16, costs=Costs(1000.0, 0.01, 2048, 8))
    replica.heartbeat_queue = True
    first = SimRequest(0, 0.0, [1, 2, 3, 4], 64, 1)
    replica.waiting.append(first)
    while replica.waiting or replica.running:
        replica.step(0.0)
    other = SimRequest(1, 1.0, [7, 8, 9], 48, 1)  # 3 blocks into a 6-block pool holding 4: one evicted
    replica.waiting.append(other)
    replica.step(1.0)
    assert other.evicted == [4]
    assert replica.true_match([1, 2, 3, 4]) == 3
