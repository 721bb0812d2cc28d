"""What `kubectl describe kvis` shows of a decision: the ScalingActive condition's message and the
Scaled Event name the measure that set the load, the queued prefill seconds with their target
when they are the larger (operator/scaling.py's describe, operator/autoscale.py)."""

from __future__ import annotations

from dataclasses import replace

from kvscale.operator import conditions
from kvscale.operator.autoscale import scaled_message, scaling_condition
from kvscale.operator.scaling import AutoscalerState, PodLoad, decide, describe, estimate_load
from kvscale.operator.spec import AutoscalingPolicy

POLICY = AutoscalingPolicy(enabled=True, min_replicas=1, max_replicas=8, target_kv_usage=0.7,
                           target_queue_length=8, target_prefill_seconds=2.0, panic_threshold=10.0)


def busy_pod(name: str, waiting: float, prefill_tokens: float, rate: float = 1000.0) -> PodLoad:
    """A replica with a full batch (16 of 16 slots), `waiting` requests and their prompt work."""
    return PodLoad(name, kv_blocks_active=100.0, kv_blocks_total=1000.0, num_requests_running=16,
                   max_num_seqs=16, num_requests_waiting=waiting,
                   prefill_tokens_waiting=prefill_tokens, prefill_tokens_per_s=rate)


def test_long_prompts_scale_up_and_the_condition_and_event_name_the_prefill_seconds() -> None:
    # 2 x 4,000 queued prompt tokens at 1,000 tokens/s: 8 s over targetPrefillSeconds 2 = 4
    # replicas; occupancy and queue alone: 2 x (1 / 0.7) + 4 / 8 = 3.36.
    pods = [busy_pod("p0", waiting=2, prefill_tokens=4000), busy_pod("p1", waiting=2, prefill_tokens=4000)]
    decision, _ = decide(0.0, pods, 2, POLICY, AutoscalerState())
    assert decision.estimate is not None and decision.estimate.set_by_prefill
    assert (decision.reason, decision.replicas) == ("ScaleUp", 4)
    why = "load 4.00 replicas from 8.0 s of prefill queued / targetPrefillSeconds 2 s"
    assert decision.message.startswith(why), decision.message
    assert "occupancy and queue alone: 3.36" in decision.message
    condition = scaling_condition(decision)
    assert (condition.type, condition.status, condition.reason) == (
        conditions.SCALING_ACTIVE, True, "ScaleUp")
    [written] = conditions.merge_conditions(None, [condition], generation=1)
    assert written["message"].startswith(why)
    assert scaled_message(2, decision).startswith(f"scaled up from 2 to 4 replicas (ScaleUp): {why}")


def test_when_occupancy_sets_the_load_it_leads_and_the_prefill_seconds_are_a_detail() -> None:
    # 8 short prompts: 0.4 s of prefill (0.2 replicas' worth) under a full batch and 8 waiting.
    estimate = estimate_load([busy_pod("p0", waiting=8, prefill_tokens=400)], POLICY)
    assert estimate is not None and not estimate.set_by_prefill
    assert describe(estimate, POLICY) == (
        "load 2.43 replicas (occupancy 100%, KV usage 10%, 8 waiting, 0.4 s of prefill queued, "
        "1/1 pods reported)")


def test_a_tie_and_a_service_without_prefill_gauges_read_as_occupancy() -> None:
    # 1 / 0.7 + 0 = 1.43 replicas either way: the prefill term changed nothing.
    tie = estimate_load([busy_pod("p0", waiting=0, prefill_tokens=1000 / 0.7 * 2)], POLICY)
    assert tie is not None and abs(tie.prefill_load - tie.occupancy_load) < 1e-9
    older = estimate_load([replace(busy_pod("p0", waiting=0, prefill_tokens=0),
                                   prefill_tokens_waiting=None, prefill_tokens_per_s=None)], POLICY)
    assert older is not None
    for estimate in (tie, older):
        assert not estimate.set_by_prefill
        assert describe(estimate, POLICY).startswith("load 1.43 replicas (occupancy 100%")
