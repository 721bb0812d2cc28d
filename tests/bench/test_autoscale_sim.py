"""The autoscaling replay's fleet simulator (bench/autoscale_sim.py): small runs whose outcome is
known, so a broken policy or fleet shows here and not as a silently odd benchmark."""

from __future__ import annotations

from bench.autoscale_replay import bursty_rate, idle_heavy, synthetic
from bench.autoscale_sim import Calibration, HpaPolicy, KvscalePolicy, reversals, simulate
from kvscale.operator.spec import AutoscalingPolicy

CAL = Calibration(prefill_tokens_per_s=2000.0, decode_step_s=0.03, kv_blocks=512, block_size=16,
                  max_num_seqs=16, step_tokens=512, cold_start_s=10.0)


def test_kvscale_at_zero_wakes_for_each_burst_and_loses_nothing() -> None:
    requests = idle_heavy()
    policy = KvscalePolicy(AutoscalingPolicy(enabled=True, min_replicas=0, max_replicas=4,
                                             scale_to_zero_after_seconds=60))
    outcome = simulate(requests, policy, CAL, start_replicas=1, hold_timeout_s=120.0)
    assert outcome.failed == 0 and all(r.finished is not None for r in outcome.requests)
    to_zero = [d for d in outcome.decisions if d[2] == 0]
    assert len(to_zero) == 6  # once after each of the six bursts
    # Each burst after the first waits for a cold start: its first TTFT covers it.
    for burst in range(1, 6):
        first = min((r for r in outcome.requests if burst * 300 <= r.arrival < (burst + 1) * 300),
                    key=lambda r: r.arrival)
        assert first.first_token - first.arrival >= CAL.cold_start_s - 0.5  # type: ignore[operator]
    hpa = simulate(requests, HpaPolicy("hpa", "concurrency", 8, 1, 4), CAL, start_replicas=1,
                   hold_timeout_s=120.0)
    assert hpa.replica_seconds > 2 * outcome.replica_seconds and not hpa.decisions


def test_a_burst_scales_up_and_reversals_count_direction_changes() -> None:
    requests = sorted(synthetic(bursty_rate(20.0), 300.0, seed=2), key=lambda r: r.arrival)
    outcome = simulate(requests, HpaPolicy("hpa", "concurrency", 4, 1, 8), CAL, start_replicas=1,
                       hold_timeout_s=120.0)
    assert max(to for _, _, to in outcome.decisions) > 1 and outcome.failed == 0
    assert reversals([(0, 1, 2), (1, 2, 3), (2, 3, 1), (3, 1, 2)]) == 2


def test_the_fleet_routes_through_kvscales_router_and_kvscale_sees_prefill_work() -> None:
    from bench.autoscale_sim import FEWEST_OPEN, Fleet, prefill_tokens_waiting
    from bench.w3_policy_sim import SimRequest

    def request(rid: int, output: int) -> SimRequest:
        hashes = [700 + i for i in range(8)] + [10_000 + rid]  # 128 shared tokens + 16 of its own
        return SimRequest(rid, 0.0, hashes, 144, output)

    waiting = {}
    for router in ("predicted-ttft", FEWEST_OPEN):
        fleet = Fleet(CAL, hold_timeout_s=60.0, router=router)
        fleet.add(0.0, cold=False)
        fleet.add(0.0, cold=False)
        first = request(0, output=200)
        fleet.route(0.0, first)
        fleet.run_pods(1.0)  # prefilled and still decoding: its prefix is cached there
        second = request(1, output=4)
        fleet.route(1.0, second)
        # kvscale's router sends the prefix back to its holder; the stand-in to the emptier one.
        assert (second.replica == first.replica) is (router != FEWEST_OPEN), router
        pod = next(p for p in fleet.pods if p.replica.index == second.replica)
        waiting[router] = prefill_tokens_waiting(pod.replica)
    # As the engine reports it: the waiting prompt less what that replica's cache holds.
    assert waiting == {"predicted-ttft": 16, FEWEST_OPEN: 144}
