"""The autoscaling replay's fleet simulator (bench/autoscale_sim.py): small runs whose outcome is
known, so a broken policy or fleet shows here and not as a silently odd benchmark."""

from __future__ import annotations

from bench.autoscale_policies import HpaPolicy, KvscalePolicy
from bench.autoscale_sim import Calibration, reversals, simulate
from bench.autoscale_workloads import bursty_rate, idle_heavy, synthetic
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
    # Two minutes at 5 and 20 requests/s (the first x4 step): ~1.5k requests, enough to scale
    # out to the maximum; the whole five-minute shape at 20/s simulated ~17k for the same answer.
    requests = sorted(synthetic(bursty_rate(5.0), 120.0, seed=2), key=lambda r: r.arrival)
    outcome = simulate(requests, HpaPolicy("hpa", "concurrency", 4, 1, 8), CAL, start_replicas=1,
                       hold_timeout_s=120.0)
    assert max(to for _, _, to in outcome.decisions) > 1 and outcome.failed == 0
    assert reversals([(0, 1, 2), (1, 2, 3), (2, 3, 1), (3, 1, 2)]) == 2


def test_the_fleet_routes_through_kvscales_router_and_kvscale_sees_prefill_work() -> None:
    from bench.autoscale_policies import prefill_tokens_waiting
    from bench.autoscale_sim import FEWEST_OPEN, Fleet
    from bench.w3_sim import SimRequest

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


# -- replicas sharing one host's cores (level (a) on a CPU machine) -----------------------------

def test_host_slowdown_is_demand_over_cores_beyond_what_the_host_holds() -> None:
    from bench.autoscale_sim import SharedHost, contention_exponent, host_slowdown

    host = SharedHost(cores=2.0, busy_cores=2.0, start_cores=1.0)
    assert host_slowdown(host, 1, 0) == 1.0  # the calibration's own conditions: full speed
    assert host_slowdown(host, 0, 1) == 1.0  # a cold start alone fits the cores
    assert host_slowdown(host, 2, 0) == 2.0  # two replicas stepping: each at half speed
    assert host_slowdown(host, 1, 1) == 1.5  # one stepping while one loads its model
    assert host_slowdown(SharedHost(2.0, 2.0, 1.0, background_cores=0.5), 1, 0) == 1.25
    # Many cores: nothing competes.
    assert host_slowdown(SharedHost(cores=64.0, busy_cores=2.0, start_cores=1.0), 3, 2) == 1.0
    # Spinning OpenMP pools: two busy replicas measured at 2.6x, not a fair share's 2x.
    exponent = contention_exponent(2.0, 2.0, 2.6)
    fitted = SharedHost(2.0, 2.0, 1.0, exponent=exponent)
    assert abs(host_slowdown(fitted, 2, 0) - 2.6) < 1e-9 and exponent > 1.0
    assert host_slowdown(fitted, 3, 0) > 3.0
    # A measurement at or below a fair share, or two replicas that fit the cores: fair share.
    assert contention_exponent(2.0, 2.0, 1.8) == 1.0 and contention_exponent(4.0, 2.0, 1.5) == 1.0


def test_a_cold_start_can_cost_a_stepping_replica_more_than_its_cpu_share() -> None:
    from dataclasses import replace

    from bench.autoscale_sim import SharedHost, host_slowdown, start_pressure, start_slowdown

    host = SharedHost(cores=2.0, busy_cores=2.0, start_cores=1.0, exponent=2.0)
    assert host_slowdown(host, 1, 1) == 1.5 ** 2  # from its CPU use alone
    # Measured: a step took 6x while a replica started; the start's pressure is fitted to that.
    fitted = replace(host, start_pressure_cores=start_pressure(host, 6.0))
    assert abs(host_slowdown(fitted, 1, 1) - 6.0) < 1e-9
    assert host_slowdown(fitted, 1, 0) == 1.0 and host_slowdown(fitted, 2, 0) == 4.0
    # The start itself progresses at a fair share of the cores, whatever its pressure.
    assert start_slowdown(fitted, 1, 1) == 1.5 and start_slowdown(fitted, 0, 1) == 1.0
    # A measurement below what its CPU use explains never lowers it.
    assert start_pressure(host, 1.0) == 1.0


def test_on_a_shared_host_a_cold_start_slows_the_serving_replica_and_itself() -> None:
    from bench.autoscale_sim import FEWEST_OPEN, Fleet, SharedHost
    from bench.w3_sim import SimRequest

    def start_second(host: SharedHost | None) -> tuple[float, float]:
        """(when the second replica is ready, the first one's decode steps done by then)."""
        fleet = Fleet(CAL, hold_timeout_s=60.0, router=FEWEST_OPEN, host=host)
        fleet.add(0.0, cold=False)
        long = SimRequest(0, 0.0, [1], 16, output_tokens=10_000)  # decodes all along
        fleet.route(0.0, long)
        fleet.add(0.0)  # cold: 10 s alone
        now = 0.0
        while not fleet.pods[1].ready(now):
            fleet.run_pods(now + fleet.tick_s)
            now += fleet.tick_s
        return fleet.pods[1].ready_at, long.generated

    alone_ready, alone_steps = start_second(None)
    shared_ready, shared_steps = start_second(SharedHost(cores=2.0, busy_cores=2.0, start_cores=1.0))
    assert abs(alone_ready - CAL.cold_start_s) < 0.1
    assert abs(shared_ready - 1.5 * CAL.cold_start_s) < 0.1  # demand 3 on 2 cores
    # The first replica decoded at 1/1.5 of its speed for the whole (longer) start.
    assert abs(shared_steps / shared_ready - alone_steps / alone_ready / 1.5) < 0.5


def test_an_idle_host_changes_nothing_and_replica_seconds_count_in_a_window() -> None:
    from bench.autoscale_sim import SharedHost

    # About one replica's capacity in the first step (x4 of 2 requests/s, from 60 s): the fleet
    # scales to 2-3.
    requests = sorted(synthetic(bursty_rate(2.0), 150.0, seed=2), key=lambda r: r.arrival)
    policy = lambda: HpaPolicy("hpa", "concurrency", 4, 1, 8)  # noqa: E731
    independent = simulate(requests, policy(), CAL, start_replicas=1, hold_timeout_s=120.0)
    roomy = simulate(requests, policy(), CAL, start_replicas=1, hold_timeout_s=120.0,
                     host=SharedHost(cores=1000.0, busy_cores=2.0, start_cores=1.0))
    # Only the cold starts' end moves, to a tick boundary.
    assert abs(roomy.replica_seconds - independent.replica_seconds) < 0.01 * independent.replica_seconds
    assert [(round(t), a, b) for t, a, b in roomy.decisions] == \
        [(round(t), a, b) for t, a, b in independent.decisions]
    tight = simulate(requests, policy(), CAL, start_replicas=1, hold_timeout_s=120.0,
                     host=SharedHost(cores=2.0, busy_cores=2.0, start_cores=1.0))
    ttft = lambda o: sorted(r.first_token - r.arrival for r in o.requests)[int(0.9 * len(o.requests))]  # noqa: E731
    assert ttft(tight) > ttft(independent)  # more replicas add no compute there
    # One replica, never scaled: the window holds exactly its seconds.
    one = simulate(requests[:5], HpaPolicy("hpa", "concurrency", 100, 1, 1), CAL, start_replicas=1,
                   hold_timeout_s=120.0, count_until=30.0)
    assert abs(one.replica_seconds_window - 30.0) < 0.06 and one.replica_seconds > 30.0


def test_a_decode_step_grows_with_its_batch_by_the_calibrated_slope() -> None:
    from bench.autoscale_calibrate import per_sequence_slope
    from bench.w3_sim import Costs, SimReplica, SimRequest

    # Steps measured at 1, 4, 8, 16 on a line 0.02 + 0.001 per sequence beyond the first.
    assert abs(per_sequence_slope({1: 0.02, 4: 0.023, 8: 0.027, 16: 0.035}) - 0.001) < 1e-12
    assert per_sequence_slope({1: 0.02, 8: 0.019}) == 0.0  # noise below the batch-1 step: flat
    assert per_sequence_slope({1: 0.02}) == 0.0

    def decode_steps(costs: Costs, batch: int) -> float:
        """Seconds of one step that only decodes ``batch`` sequences."""
        replica = SimReplica(0, 512, 16, costs)
        for rid in range(batch):
            replica.waiting.append(SimRequest(rid, 0.0, [1000 + rid], 16, output_tokens=10))
        end, _, _ = replica.step(0.0)  # their prefills
        return replica.step(end)[0] - end

    flat = Costs(2000.0, 0.02, 512, 16)
    sloped = Costs(2000.0, 0.02, 512, 16, decode_step_per_seq_s=0.001)
    assert abs(decode_steps(flat, 8) - 0.02) < 1e-9
    assert abs(decode_steps(sloped, 1) - 0.02) < 1e-9
    assert abs(decode_steps(sloped, 8) - 0.027) < 1e-9


def test_step_factors_vary_steps_around_the_calibrated_mean_reproducibly() -> None:
    from bench.autoscale_sim import FEWEST_OPEN, Fleet, SharedHost
    from bench.w3_sim import SimRequest

    def decode_steps(host: SharedHost) -> tuple[int, list[float]]:
        """(tokens one replica alone on ``host`` decodes in 30 s, when each tick's steps ended)."""
        fleet = Fleet(CAL, hold_timeout_s=60.0, router=FEWEST_OPEN, host=host)
        fleet.add(0.0, cold=False)
        request = SimRequest(0, 0.0, [1], 16, output_tokens=100_000)
        fleet.route(0.0, request)
        ends, now = [], 0.0
        while now < 30.0:
            fleet.run_pods(now + fleet.tick_s)
            now += fleet.tick_s
            ends.append(fleet.pods[0].busy_until)
        return request.generated, ends

    roomy = dict(cores=1000.0, busy_cores=2.0, start_cores=1.0)
    plain, plain_ends = decode_steps(SharedHost(**roomy))
    varied, varied_ends = decode_steps(SharedHost(**roomy, step_factors=(0.5, 1.5)))
    assert decode_steps(SharedHost(**roomy, step_factors=(0.5, 1.5))) == (varied, varied_ends)  # seeded
    doubled, _ = decode_steps(SharedHost(**roomy, step_factors=(2.0,)))
    assert abs(plain - 30.0 / CAL.decode_step_s) < 3
    assert abs(doubled / plain - 0.5) < 0.02  # each step stretched by its factor
    assert abs(varied / plain - 1.0) < 0.1  # factors averaging 1 keep the calibrated mean
    assert varied_ends != plain_ends


def test_at_equal_attainment_reads_the_baselines_settings_at_kvscales_attainment() -> None:
    from bench.autoscale_replay import at_equal_attainment

    def f(attained: float, seconds: float) -> dict:
        return {"slo_attainment": attained, "replica_seconds": seconds}

    policies = {"kvscale": f(0.90, 800.0), "hpa-concurrency": f(0.80, 500.0),
                "hpa-concurrency4": f(0.95, 1400.0), "hpa-concurrency2": f(1.0, 1600.0),
                "hpa-concurrency-other": f(0.99, 10.0),  # not one of its settings
                "keda-queue": f(0.85, 700.0), "keda-queue2": f(0.88, 750.0)}
    hpa = at_equal_attainment(policies, "hpa-concurrency")
    # From 0.80 towards 0.95: 500 + 2/3 * 900 = 1100; towards 1.0: 500 + 1/2 * 1100 = 1050.
    assert hpa["between"] == ["hpa-concurrency", "hpa-concurrency2"]
    assert abs(hpa["replica_seconds"] - 1050.0) < 1e-9 and abs(hpa["ratio"] - 800 / 1050) < 1e-12
    keda = at_equal_attainment(policies, "keda-queue")
    assert keda["ratio"] is None and keda["reason"] == "no setting reaches kvscale's attainment"
    low = at_equal_attainment({**policies, "kvscale": f(0.5, 100.0)}, "hpa-concurrency")
    assert low["ratio"] is None and low["reason"] == "kvscale attains less than every setting"
    # At a setting's own attainment the line from a cheaper, lower one to a higher one can pass
    # below it: the baseline is given the cheaper (0.80 -> 1.0: 500 + 3/4 * 1100 = 1325).
    exact = at_equal_attainment({**policies, "kvscale": f(0.95, 700.0)}, "hpa-concurrency")
    assert abs(exact["replica_seconds"] - 1325.0) < 1e-9


def test_each_kvscale_setting_is_read_against_the_baselines_at_its_own_attainment() -> None:
    from bench.autoscale_replay import at_equal_attainment

    def f(attained: float, seconds: float) -> dict:
        return {"slo_attainment": attained, "replica_seconds": seconds}

    policies = {"kvscale": f(0.5, 100.0), "kvscale-kv0.25": f(0.90, 800.0),
                "hpa-concurrency": f(0.80, 500.0), "hpa-concurrency2": f(1.0, 1600.0)}
    tuned = at_equal_attainment(policies, "hpa-concurrency", "kvscale-kv0.25")
    assert abs(tuned["replica_seconds"] - 1050.0) < 1e-9 and abs(tuned["ratio"] - 800 / 1050) < 1e-12
    assert at_equal_attainment(policies, "hpa-concurrency")["ratio"] is None


def test_the_attainable_share_counts_only_what_an_idle_replica_with_every_earlier_block_meets() -> None:
    from bench.autoscale_workloads import BLOCK, attainable_ttft_share
    from bench.w3_sim import SimRequest

    calibration = Calibration(prefill_tokens_per_s=100.0, decode_step_s=0.05, kv_blocks=100, block_size=BLOCK,
                              max_num_seqs=16, step_tokens=512, cold_start_s=5.0)
    long_prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 10 blocks: 160 tokens, 1.6 s alone
    requests = [
        SimRequest(0, 0.0, long_prompt, 10 * BLOCK, 4),  # nothing cached before it: over 1 s
        SimRequest(1, 1.0, long_prompt[:9] + [11], 10 * BLOCK, 4),  # 9 blocks seen: 0.16 s
        SimRequest(2, 2.0, [12], BLOCK, 4),  # short: 0.16 s
        SimRequest(3, 3.0, [13, *long_prompt], 11 * BLOCK, 4, answer_hashes=[14]),  # its first block is new
        SimRequest(4, 4.0, [13, 14, 15], 3 * BLOCK, 4),  # the first two were written by request 3
    ]
    # Requests 0 and 3 miss a 1 s target on any fleet; the rest can meet it.
    assert attainable_ttft_share(requests, calibration, 1.0) == 3 / 5
    assert attainable_ttft_share(requests, calibration, 2.0) == 1.0
