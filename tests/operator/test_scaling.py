"""The scaling rule on recorded metric sequences (pure: no cluster, no clock)."""

from __future__ import annotations

from dataclasses import replace

from kvscale.operator.scaling import AutoscalerState, Demand, PodLoad, decide, estimate_load
from kvscale.operator.spec import AutoscalingPolicy

POLICY = AutoscalingPolicy(
    enabled=True, min_replicas=1, max_replicas=10, target_kv_usage=0.7, target_queue_length=8,
    scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=60,
    panic_window_seconds=6, panic_threshold=2.0, max_scale_up_rate=2.0,
)
TOTAL = 1000.0


def pods(usages: list[float | None], waiting: float = 0.0, error: str = "") -> list[PodLoad]:
    """One ready pod per entry; None is a pod whose scrape gave nothing."""
    return [
        PodLoad(f"p{i}", error=error or "no metrics") if u is None
        else PodLoad(f"p{i}", kv_blocks_active=u * TOTAL, kv_blocks_total=TOTAL,
                     num_requests_waiting=waiting)
        for i, u in enumerate(usages)
    ]


def fleet(demand: float, replicas: int, queue_per_unit: float = 8.0) -> list[PodLoad]:
    """`demand` pods' worth of KV occupancy spread over `replicas` ready pods; what does not fit
    waits in their queues (`queue_per_unit` requests per pod's worth)."""
    n = max(replicas, 1)
    usage = min(1.0, demand / n)
    overflow = max(0.0, demand - n) * queue_per_unit / n
    return pods([usage] * n, waiting=overflow)


def replay(sequence, policy=POLICY, start=1, period=2.0, ready=lambda replicas: replicas):
    """Run the rule every `period` seconds; `sequence(i, ready_pods)` gives the pods' usages.

    Returns the replicas after each tick and the decisions. New replicas are ready at the next
    tick (ready=) unless told otherwise.
    """
    replicas, state, history, decisions = start, AutoscalerState(), [], []
    for i, step in enumerate(sequence):
        loads = step(ready(replicas)) if callable(step) else step
        decision, state = decide(i * period, loads, replicas, policy, state)
        replicas = decision.replicas
        history.append(replicas)
        decisions.append(decision)
    return history, decisions


def test_load_is_sum_of_usage_over_target_plus_queue():
    estimate = estimate_load(pods([0.7, 0.35], waiting=4), POLICY)
    assert estimate is not None
    assert abs(estimate.load - ((0.7 + 0.35) / 0.7 + 8 / 8)) < 1e-9
    assert abs(estimate.kv_usage - 0.525) < 1e-9 and estimate.waiting == 8


def test_requests_waiting_in_the_routers_count_as_waiting():
    estimate = estimate_load(pods([0.7, 0.35], waiting=4), POLICY, queued=16)
    assert estimate is not None and estimate.waiting == 24
    assert abs(estimate.load - ((0.7 + 0.35) / 0.7 + 24 / 8)) < 1e-9
    # The servers' batches full and nothing waiting there: the routers' queue alone asks for more.
    full = pods([0.7, 0.7])
    alone, _ = decide(0.0, full, 2, POLICY, AutoscalerState())
    queued, _ = decide(0.0, full, 2, POLICY, AutoscalerState(), Demand(queued=16))
    assert queued.replicas > alone.replicas


def batch_pod(name: str, running: float, kv_usage: float = 0.1, max_num_seqs: float | None = 16.0,
              waiting: float = 0.0) -> PodLoad:
    """A CPU-like replica: a large KV pool, few batch slots."""
    return PodLoad(name, kv_blocks_active=kv_usage * TOTAL, kv_blocks_total=TOTAL,
                   num_requests_running=running, num_requests_waiting=waiting,
                   max_num_seqs=max_num_seqs)


def test_occupancy_is_the_fuller_of_kv_blocks_and_batch_slots():
    full_batch = batch_pod("p0", running=16, kv_usage=0.1)
    kv_bound = batch_pod("p1", running=2, kv_usage=0.9)
    assert full_batch.occupancy == 1.0 and abs(kv_bound.occupancy - 0.9) < 1e-9
    estimate = estimate_load([full_batch, kv_bound], POLICY)
    assert estimate is not None
    assert abs(estimate.load - (1.0 + 0.9) / 0.7) < 1e-9
    assert abs(estimate.occupancy - 0.95) < 1e-9 and abs(estimate.kv_usage - 0.5) < 1e-9


def test_a_full_batch_scales_up_though_kv_usage_is_low():
    # One replica with every batch slot taken and 4 requests queued behind it, 10 % of its KV pool
    # in use: KV usage alone says 0.1 / 0.7 + 4 / 8 = 0.64 replicas (stay at one); the batch says
    # 1 / 0.7 + 0.5 = 1.93.
    decision, _ = decide(0.0, [batch_pod("p0", running=16, waiting=4)], 1, POLICY, AutoscalerState())
    assert (decision.replicas, decision.reason) == (2, "ScaleUp")
    kv_only, _ = decide(0.0, [batch_pod("p0", running=16, waiting=4, max_num_seqs=None)], 1, POLICY,
                        AutoscalerState())
    assert (kv_only.replicas, kv_only.reason) == (1, "Stable")


def prompt_pod(name: str, waiting: float, prefill_tokens: float, rate: float | None,
               running: float = 16.0) -> PodLoad:
    """A busy replica with ``waiting`` requests holding ``prefill_tokens`` of prompt work."""
    return PodLoad(name, kv_blocks_active=0.1 * TOTAL, kv_blocks_total=TOTAL,
                   num_requests_running=running, num_requests_waiting=waiting, max_num_seqs=16.0,
                   prefill_tokens_waiting=prefill_tokens, prefill_tokens_per_s=rate)


def test_long_prompts_queued_count_in_seconds_of_prefill_not_in_requests():
    # Two waiting requests of 2,000 prompt tokens at 1,000 tokens/s: 4 s of prefill ahead of the
    # next arrival. Slots and count say 1 / 0.7 + 2 / 8 = 1.7 replicas; the work says 4 at
    # targetPrefillSeconds 1, and either is enough to need them.
    pod = prompt_pod("p0", waiting=2, prefill_tokens=4000, rate=1000.0)
    estimate = estimate_load([pod], POLICY)
    assert estimate is not None
    assert estimate.prefill_seconds == 4.0
    assert abs(estimate.load - 4.0) < 1e-9
    decision, _ = decide(0.0, [pod], 1, replace(POLICY, panic_threshold=10.0), AutoscalerState())
    assert decision.reason == "ScaleUp" and decision.replicas == 2  # +100 % per step


def test_short_prompts_leave_occupancy_in_charge_and_are_not_counted_twice():
    # Eight waiting 50-token prompts at 1,000 tokens/s: 0.4 s of prefill. The occupancy measure
    # (a full batch, eight waiting) is larger and stands alone: the prompts are not added on top.
    estimate = estimate_load([prompt_pod("p0", waiting=8, prefill_tokens=400, rate=1000.0)], POLICY)
    assert estimate is not None
    assert abs(estimate.load - (1.0 / 0.7 + 8 / 8)) < 1e-9


def test_prefill_seconds_use_each_pods_own_rate_and_the_median_for_an_unmeasured_one():
    slow = prompt_pod("slow", waiting=1, prefill_tokens=500, rate=250.0)   # 2 s
    fast = prompt_pod("fast", waiting=1, prefill_tokens=500, rate=1000.0)  # 0.5 s
    new = prompt_pod("new", waiting=1, prefill_tokens=500, rate=0.0)       # median 625/s: 0.8 s
    estimate = estimate_load([slow, fast, new], POLICY)
    assert estimate is not None and abs(estimate.prefill_seconds - 3.3) < 1e-9
    # No pod measured yet (a service that just started): the prompt work cannot be timed, the
    # request count still counts.
    unmeasured = estimate_load([prompt_pod("p0", waiting=4, prefill_tokens=9000, rate=None)], POLICY)
    assert unmeasured is not None and unmeasured.prefill_seconds == 0.0
    assert abs(unmeasured.load - (1.0 / 0.7 + 4 / 8)) < 1e-9


def test_prefill_seconds_of_a_pod_without_metrics_are_extrapolated():
    estimate = estimate_load([prompt_pod("p0", waiting=0, prefill_tokens=1000, rate=1000.0),
                              PodLoad("p1", error="scrape timed out")], POLICY)
    assert estimate is not None and estimate.prefill_seconds == 2.0


def test_steady_load_keeps_replicas():
    # 3 pods at exactly the target: ceil(3 * 0.7 / 0.7) = 3, never 4 through float rounding.
    history, decisions = replay([pods([0.7, 0.7, 0.7])] * 60, start=3)
    assert history == [3] * 60
    assert {d.reason for d in decisions} == {"Stable"}


def test_scale_up_is_immediate_and_rate_limited():
    # Demand of 9 pods' worth hits one replica: the queue says so, and each step at most doubles.
    history, _ = replay([lambda n: fleet(9.0, n)] * 6, start=1)
    assert history[:4] == [2, 4, 8, 10]  # bounded by maxReplicas 10 at the end
    assert history[4:] == [10, 10]


def test_burst_triggers_panic_and_no_scale_down_while_it_lasts():
    calm = pods([0.3, 0.3])
    burst = pods([1.0, 1.0], waiting=40)  # load = 2/0.7 + 80/8 = 12.9 >= 2.0 x 2 replicas
    history, decisions = replay([calm] * 5 + [burst] + [calm] * 2, start=2)
    assert history[:5] == [2] * 5
    burst_decision = decisions[5]
    assert burst_decision.panic and burst_decision.reason == "Panic"
    assert history[5] == 4  # panic goes up at once, still bounded by maxScaleUpRate
    # Within the panic window the next ticks keep climbing toward the burst's recommendation.
    assert history[6] == 8 and decisions[6].panic
    assert history[7] >= history[6]


def test_scale_up_stabilization_needs_sustained_load():
    policy = replace(POLICY, scale_up_stabilization_seconds=10)
    high = pods([0.95])  # wants 2
    low = pods([0.3])
    # A single spike (not a panic: 1.36 < 2.0 x 1) does not scale; 10 s of it does.
    history, _ = replay([low, high, low, low] + [high] * 7, policy=policy, start=1)
    assert history[:4] == [1, 1, 1, 1]
    assert history[-1] == 2 and history[4:9] == [1] * 5


def test_slow_decay_steps_down_only_after_the_window():
    # Demand falls from 4 pods' worth to 0.2 over 400 s; replicas follow the highest
    # recommendation of the last 60 s, so they lag the decay by the window and step down gently.
    demands = [max(0.2, 4.0 - 0.02 * i) for i in range(200)]
    history, _ = replay([lambda n, d=d: fleet(d, n) for d in demands], start=6, period=2.0)
    assert history[0] == 6  # ceil(4 / 0.7)
    assert all(b <= a for a, b in zip(history, history[1:], strict=False)), "never up during decay"
    first_down = next(i for i, r in enumerate(history) if r < 6)
    assert first_down * 2.0 >= 60  # not before the stabilization window has passed
    assert history[-1] == 1
    downs = [a - b for a, b in zip(history, history[1:], strict=False) if b < a]
    assert max(downs) == 1  # gradual, not a cliff


def test_flapping_load_does_not_flap_replicas():
    # Demand alternates every tick between 2.7 pods' worth (wants 4) and 0.6 (wants 1).
    history, decisions = replay([lambda n, i=i: fleet(2.7 if i % 2 == 0 else 0.6, n)
                                 for i in range(60)], start=3)
    assert history == [4] * 60
    assert decisions[-1].reason == "Stable"
    # Once the demand stays low for a whole window, replicas follow it down.
    calm, _ = replay([lambda n, i=i: fleet(2.7 if i % 2 == 0 and i < 20 else 0.6, n)
                      for i in range(60)], start=3)
    assert calm[19] == 4 and calm[-1] == 1 and calm.index(1) * 2.0 >= 18 * 2.0 + 60


def test_pod_without_metrics_is_extrapolated_and_blocks_scale_down():
    policy = replace(POLICY, scale_down_stabilization_seconds=0)
    # 4 pods, one silent: the others' mean stands in for it.
    estimate = estimate_load(pods([0.7, 0.7, 0.7, None]), policy)
    assert estimate is not None and abs(estimate.load - 4.0) < 1e-9 and estimate.reported == 3
    # Idle pods would scale down, but not while a pod is silent: it may be the busy one.
    decision, _ = decide(0.0, pods([0.1, 0.1, 0.1, None]), 4, policy, AutoscalerState())
    assert decision.replicas == 4 and decision.reason == "IncompleteMetrics"
    decision, _ = decide(0.0, pods([0.1, 0.1, 0.1, 0.1]), 4, policy, AutoscalerState())
    assert decision.replicas == 1 and decision.reason == "ScaleDown"


def test_scrape_timeouts_hold_replicas():
    timed_out = pods([None, None], error="scrape timed out")
    history, decisions = replay([pods([0.2, 0.2])] * 3 + [timed_out] * 5, start=2)
    assert history == [2] * 8
    assert decisions[-1].reason == "NoMetrics" and "timed out" in decisions[-1].message
    assert decisions[-1].estimate is None


def test_no_scale_down_before_watching_a_full_window():
    # A restarted operator has no history: it must not scale down on its first idle sample.
    decision, state = decide(100.0, pods([0.0, 0.0, 0.0]), 3, POLICY, AutoscalerState())
    assert decision.replicas == 3 and decision.reason == "WarmingUp"
    decision, _ = decide(161.0, pods([0.0, 0.0, 0.0]), 3, POLICY, state)
    assert decision.replicas == 1


def test_bounds_are_enforced_even_without_load_changes():
    policy = replace(POLICY, min_replicas=2, max_replicas=3)
    decision, _ = decide(0.0, pods([0.5] * 5), 5, policy, AutoscalerState())
    assert decision.replicas == 3 and decision.reason == "Bounds"
    decision, _ = decide(0.0, [], 0, policy, AutoscalerState())
    assert decision.replicas == 2


# --- scale to and from zero (minReplicas 0) ----------------------------------------------------
ZERO = replace(POLICY, min_replicas=0, scale_to_zero_after_seconds=30)


def idle_pods(n: int) -> list[PodLoad]:
    return [PodLoad(f"p{i}", kv_blocks_active=0, kv_blocks_total=TOTAL, num_requests_waiting=0,
                    num_requests_running=0) for i in range(n)]


def test_a_held_request_at_zero_brings_one_replica_at_once_and_nothing_stays_at_zero() -> None:
    from kvscale.operator.scaling import Demand

    decision, _ = decide(0.0, [], 0, ZERO, AutoscalerState(), Demand(held=5, idle_seconds=0.0))
    assert (decision.replicas, decision.reason) == (1, "Activate")
    decision, _ = decide(0.0, [], 0, ZERO, AutoscalerState(), Demand(held=0, idle_seconds=999.0))
    assert (decision.replicas, decision.reason) == (0, "ScaledToZero")
    # minReplicas 1 is unchanged: no pods, back up to the minimum.
    decision, _ = decide(0.0, [], 0, POLICY, AutoscalerState(), Demand(held=0))
    assert decision.replicas == 1


def test_zero_only_after_the_idle_window_with_nothing_open_anywhere() -> None:
    from kvscale.operator.scaling import Demand

    state = AutoscalerState()
    for idle, pods_now, held, want in (
            (29.0, idle_pods(1), 0, 1),        # not idle long enough
            (None, idle_pods(1), 0, 1),        # a router did not say
            (31.0, idle_pods(1), 2, 1),        # requests held (a replica is coming)
            (31.0, [replace(idle_pods(1)[0], num_requests_running=1)], 0, 1),  # around the router
            (31.0, [PodLoad("p0", error="scrape timed out")], 0, 1),  # a silent pod may be busy
            (31.0, idle_pods(2), 0, 0)):       # idle for the window: straight to zero
        decision, state = decide(10.0, pods_now, len(pods_now), ZERO, state,
                                 Demand(held=held, idle_seconds=idle))
        assert decision.replicas == want, (idle, pods_now, held, decision)
    assert decision.reason == "ScaleToZero" and "31 s" in decision.message


def test_the_load_rule_never_takes_the_last_replica_with_min_zero() -> None:
    from kvscale.operator.scaling import Demand

    state = AutoscalerState()
    for t in range(0, 200, 5):  # idle pods but a busy router (idle 0): load says 0, keep 1
        decision, state = decide(float(t), idle_pods(1), 1, ZERO, state, Demand(idle_seconds=0.0))
        assert decision.replicas == 1
    decision, state = decide(200.0, idle_pods(3), 3, ZERO, state, Demand(idle_seconds=0.0))
    assert decision.replicas in (1, 3) and decision.reason in ("ScaleDown", "WarmingUp")


def test_sparse_traffic_scales_down_at_most_once_per_idle_window() -> None:
    """One request every 1.5 x the idle window, each taking 2 s: the fleet goes 0 -> 1 -> 0
    once per request, never more (no flapping inside a window)."""
    from kvscale.operator.scaling import Demand

    window, period, tick = 30.0, 45.0, 1.0
    replicas, state, last_end = 0, AutoscalerState(), -1e9
    downs, ups = [], []
    t = 0.0
    while t < 10 * period:
        arrival = (t // period) * period
        busy = arrival <= t < arrival + 2.0
        if busy:
            last_end = arrival + 2.0
        held = 1 if busy and replicas == 0 else 0
        idle = 0.0 if busy else t - last_end
        decision, state = decide(t, idle_pods(replicas), replicas, ZERO, state,
                                 Demand(held=held, idle_seconds=idle))
        if decision.replicas < replicas:
            downs.append(t)
        elif decision.replicas > replicas:
            ups.append(t)
        replicas = decision.replicas
        t += tick
    assert len(ups) == len(downs) == 10
    assert all(b - a >= window for a, b in zip(downs, downs[1:], strict=False))
    assert all(d % period >= 2.0 + window for d in downs)  # only after a full idle window
