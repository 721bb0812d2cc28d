"""The KV-occupancy scaling rule: a pure function from metric samples and the previous state to a
decision and the next state.

Load is measured in replicas' worth of demand:

    load = max(Σ occupancy / targetKVUsage + Σ waiting / targetQueueLength,
               Σ queued prefill seconds / targetPrefillSeconds)
    occupancy = max(kv_usage, running / max_num_seqs)
    queued prefill seconds = prefill_tokens_waiting / prefill_tokens_per_s

where kv_usage is a pod's share of KV blocks held by live requests (`kvscale:kv_blocks_active /
kvscale:kv_blocks_total`), running / max_num_seqs its share of batch slots in use
(`vllm:num_requests_running / kvscale:max_num_seqs`) and waiting its `vllm:num_requests_waiting`,
plus the requests waiting in the routers' queues (`--max-queue-wait`), which the servers never
see while they have no room.
A replica is full when either runs out: on a GPU with a long context the KV pool usually goes
first, on a CPU replica (a pool of thousands of blocks, a batch of 16) the batch slots do, and a
KV-only signal then stays low while requests queue behind a full batch. Waiting requests hold no
KV blocks or slots yet, so their demand adds to the occupancy rather than duplicating it. Each
observation recommends ceil(load) replicas, bounded by min/max.

The second measure is prompt work: a replica's queued prefill in seconds
(`kvscale:prefill_tokens_waiting / kvscale:prefill_tokens_per_s`, its own measured rate) is about
what a request arriving there waits for its first token behind the prompts ahead of it, and the
fleet wants enough replicas that this wait stays at targetPrefillSeconds. Slots, KV and a count of
waiting requests are blind to prompt length: eight waiting 200-token prompts and eight
8,000-token ones are the same queue to them, while the second is forty times the wait. Where
prefill compute binds (long prompts, a slow replica) the seconds ask for more replicas than
occupancy does; elsewhere occupancy does and the seconds change nothing. Either is enough to need
that many replicas, so the load is the larger (not the sum: a queued prompt is both a waiting
request and prefill work). A replica that has not measured its rate yet takes the median of
those that have; when none has, its prompt work counts as nothing (occupancy still does).

- Scale up to the smallest recommendation of the last scaleUpStabilizationSeconds (0: at once).
- Scale down to the largest recommendation of the last scaleDownStabilizationSeconds, only once the
  autoscaler has watched for that long and only when every pod reported: a pod without metrics
  may be the busiest one.
- Panic (as Knative's KPA): when an observation within panicWindowSeconds asked for at least
  panicThreshold x the replicas of its time, go straight to the highest recommendation of that
  window and never scale down while it lasts. KV occupancy saturates at 100%, so in practice a
  burst shows as a queue.
- A step up adds at most max(1, (maxScaleUpRate - 1) x current) replicas.
- Pods without metrics (not exported yet, scrape timeout, HTTP error) are assumed to carry the mean
  load of those that reported; when none reported, nothing is decided.

Scale to zero (minReplicas 0) is not a load decision: the load rule never goes below one replica.
Zero comes from the routers' `Demand`: nothing open or held on any router for
scaleToZeroAfterSeconds, and no pod busy. From zero, a request a router holds brings one replica
at once (reason Activate); the routers also raise the scale themselves, this is the fallback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvscale.operator.spec import AutoscalingPolicy

# Decisions of minReplicas 0 made from the routers' demand, not from pod metrics.
ZERO_REASONS = ("Activate", "ScaleToZero", "ScaledToZero")
# ceil(0.7 / 0.7) must be 1, not 2, whatever the float rounding; equal measures tie likewise.
_CEIL_TOLERANCE = 1e-9


@dataclass(frozen=True)
class PodLoad:
    """One ready pod's scrape: the metrics, or why there are none."""

    pod: str
    kv_blocks_active: float | None = None
    kv_blocks_total: float | None = None
    num_requests_waiting: float | None = None
    num_requests_running: float | None = None
    kv_blocks_cached: float | None = None  # free blocks still holding a reusable prefix
    max_num_seqs: float | None = None  # batch slots; None from a server that does not say
    prefill_tokens_waiting: float | None = None  # prompt tokens still to compute there
    prefill_tokens_per_s: float | None = None  # its measured prefill rate (0/None: unmeasured)
    error: str = ""

    @property
    def has_metrics(self) -> bool:
        return (self.kv_blocks_active is not None and self.kv_blocks_total is not None
                and self.kv_blocks_total > 0)

    @property
    def kv_usage(self) -> float:
        assert self.kv_blocks_active is not None and self.kv_blocks_total
        return min(1.0, max(0.0, self.kv_blocks_active / self.kv_blocks_total))

    @property
    def slot_usage(self) -> float:
        if not self.max_num_seqs:
            return 0.0
        return min(1.0, max(0.0, (self.num_requests_running or 0.0) / self.max_num_seqs))

    @property
    def occupancy(self) -> float:
        """The fuller of the replica's two limits: KV blocks and batch slots."""
        return max(self.kv_usage, self.slot_usage)


@dataclass(frozen=True)
class Demand:
    """What the routers say, summed over the ready ones: requests held for a replica (the service
    at zero), and for how long no request has been open or held on any of them."""

    held: int = 0
    idle_seconds: float | None = None  # None: some router did not say (unknown: never idle)
    queued: int = 0  # requests waiting in the routers' queues for room on a server


@dataclass(frozen=True)
class Observation:
    time: float
    load: float
    replicas: int  # replicas wanted when it was observed


@dataclass(frozen=True)
class AutoscalerState:
    observations: tuple[Observation, ...] = ()
    watching_since: float | None = None


@dataclass(frozen=True)
class LoadEstimate:
    load: float
    kv_usage: float  # mean over the pods that reported
    occupancy: float  # mean over the pods that reported: max(KV usage, slot usage) per pod
    waiting: float   # total, missing pods extrapolated
    reported: int
    pods: int
    prefill_seconds: float = 0.0  # queued prompt work, total, missing pods extrapolated
    # The two measures the load is the larger of, in replicas' worth (module docstring).
    occupancy_load: float = 0.0  # Σ occupancy / targetKVUsage + Σ waiting / targetQueueLength
    prefill_load: float = 0.0    # Σ prefill seconds / targetPrefillSeconds

    @property
    def set_by_prefill(self) -> bool:
        """The queued prompt work, not occupancy and queue, asked for more replicas (a tie is
        occupancy's: the prefill term then changed nothing, float rounding aside)."""
        return self.prefill_load > self.occupancy_load + _CEIL_TOLERANCE


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    # ScaleUp, ScaleDown, Panic, Stable, NoMetrics, IncompleteMetrics, WarmingUp, Bounds,
    # and with minReplicas 0: Activate, ScaleToZero, ScaledToZero
    reason: str
    message: str
    estimate: LoadEstimate | None = None
    panic: bool = False


def prefill_seconds(pods: list[PodLoad]) -> list[float]:
    """Each pod's queued prompt work in seconds at its own measured rate; a pod that has not
    measured one yet (a new replica) borrows the median of those that have."""
    measured = sorted(rate for p in pods if (rate := p.prefill_tokens_per_s))
    fallback = 0.0
    if measured:
        middle = len(measured) // 2
        fallback = (measured[middle] if len(measured) % 2
                    else (measured[middle - 1] + measured[middle]) / 2)
    out = []
    for p in pods:
        rate = p.prefill_tokens_per_s or fallback
        out.append(max(0.0, p.prefill_tokens_waiting or 0.0) / rate if rate > 0 else 0.0)
    return out


def estimate_load(pods: list[PodLoad], policy: AutoscalingPolicy,
                  queued: float = 0.0) -> LoadEstimate | None:
    """``queued``: requests waiting in the routers, counted with the servers' waiting ones."""
    reported = [p for p in pods if p.has_metrics]
    if not reported:
        return None
    occupancy_sum = sum(p.occupancy for p in reported)
    waiting_sum = sum(p.num_requests_waiting or 0.0 for p in reported)
    prefill_sum = sum(prefill_seconds(reported))
    scale = len(pods) / len(reported)  # missing pods carry the mean
    occupancy_total, waiting_total = occupancy_sum * scale, waiting_sum * scale + queued
    prefill_total = prefill_sum * scale
    # Two measures of the replicas needed (module docstring); either suffices, so the larger.
    occupancy_load = (occupancy_total / policy.target_kv_usage
                      + waiting_total / policy.target_queue_length)
    prefill_load = prefill_total / policy.target_prefill_seconds
    return LoadEstimate(load=max(occupancy_load, prefill_load),
                        kv_usage=sum(p.kv_usage for p in reported) / len(reported),
                        occupancy=occupancy_sum / len(reported), waiting=waiting_total,
                        reported=len(reported), pods=len(pods), prefill_seconds=prefill_total,
                        occupancy_load=occupancy_load, prefill_load=prefill_load)


def describe(estimate: LoadEstimate, policy: AutoscalingPolicy) -> str:
    """Why the load is what it is, for the ScalingActive condition and the Scaled Event. When the
    prefill seconds set it, they come first with their target: a reader comparing the occupancy
    figures with targetKVUsage would otherwise find no reason for the replicas asked for."""
    occupancy = (f"occupancy {estimate.occupancy:.0%}, KV usage {estimate.kv_usage:.0%}, "
                 f"{estimate.waiting:.0f} waiting")
    reported = f"{estimate.reported}/{estimate.pods} pods reported"
    if estimate.set_by_prefill:
        return (f"load {estimate.load:.2f} replicas from {estimate.prefill_seconds:.1f} s of "
                f"prefill queued / targetPrefillSeconds {policy.target_prefill_seconds:g} s "
                f"(occupancy and queue alone: {estimate.occupancy_load:.2f}; {occupancy}; "
                f"{reported})")
    return (f"load {estimate.load:.2f} replicas ({occupancy}, "
            f"{estimate.prefill_seconds:.1f} s of prefill queued, {reported})")


def clamp(replicas: int, policy: AutoscalingPolicy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, replicas))


def recommend(load: float, policy: AutoscalingPolicy) -> int:
    return clamp(math.ceil(load - _CEIL_TOLERANCE), policy)


def max_step_up(current: int, policy: AutoscalingPolicy) -> int:
    return max(current + 1, math.ceil(current * policy.max_scale_up_rate - _CEIL_TOLERANCE))


def decide(
    now: float,
    pods: list[PodLoad],
    current: int,
    policy: AutoscalingPolicy,
    state: AutoscalerState,
    demand: Demand | None = None,
) -> tuple[ScaleDecision, AutoscalerState]:
    """Replicas to run now; `current` is the replicas wanted so far (spec.replicas); `demand`
    what the routers say (it matters only with minReplicas 0)."""
    demand = demand or Demand()
    if policy.min_replicas != 0:
        return decide_by_load(now, pods, current, policy, state, demand.queued)
    since = state.watching_since if state.watching_since is not None else now
    if current == 0:
        if demand.held > 0:
            wanted = min(1, policy.max_replicas)
            return (ScaleDecision(wanted, "Activate",
                                  f"{demand.held} request(s) held by the routers"),
                    AutoscalerState(watching_since=since))
        return (ScaleDecision(0, "ScaledToZero", "no request held"),
                AutoscalerState(watching_since=since))
    # The load rule keeps at least one replica; only idleness takes the last one away.
    decision, next_state = decide_by_load(
        now, pods, current, replace(policy, min_replicas=1), state, demand.queued)
    if decision.replicas <= current and idle_for_zero(pods, policy, demand):
        return (ScaleDecision(0, "ScaleToZero",
                              f"no request open or held for {demand.idle_seconds:.0f} s "
                              f"(scaleToZeroAfterSeconds {policy.scale_to_zero_after_seconds})",
                              decision.estimate),
                AutoscalerState(watching_since=next_state.watching_since))
    return decision, next_state


def idle_for_zero(pods: list[PodLoad], policy: AutoscalingPolicy, demand: Demand) -> bool:
    """The routers saw nothing for the idle window and no pod that reported is working; a pod
    that did not report may be (a request sent to it around the routers)."""
    if demand.held > 0 or demand.idle_seconds is None:
        return False
    if demand.idle_seconds < policy.scale_to_zero_after_seconds:
        return False
    return all(p.has_metrics and not p.kv_blocks_active and not p.num_requests_waiting
               and not p.num_requests_running for p in pods)


def decide_by_load(
    now: float,
    pods: list[PodLoad],
    current: int,
    policy: AutoscalingPolicy,
    state: AutoscalerState,
    queued: float = 0.0,
) -> tuple[ScaleDecision, AutoscalerState]:
    """The KV-occupancy rule alone (the module's docstring); ``queued``: the routers' waiting."""
    since = state.watching_since if state.watching_since is not None else now
    estimate = estimate_load(pods, policy, queued)
    if estimate is None:
        held = clamp(current, policy)
        why = "; ".join(f"{p.pod}: {p.error or 'no KV metrics'}" for p in pods) or "no ready pods"
        return (ScaleDecision(held, "NoMetrics" if held == current else "Bounds",
                              f"no pod reported metrics ({why})"),
                replace(state, watching_since=since))

    horizon = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds,
                  policy.panic_window_seconds)
    observations = tuple(o for o in state.observations if now - o.time <= horizon)
    observations += (Observation(time=now, load=estimate.load, replicas=current),)
    next_state = AutoscalerState(observations=observations, watching_since=since)

    def within(seconds: float) -> list[Observation]:
        return [o for o in observations if now - o.time <= seconds]

    panic_window = within(policy.panic_window_seconds)
    panic = any(o.load >= policy.panic_threshold * max(o.replicas, 1) for o in panic_window)
    summary = describe(estimate, policy)

    if panic:
        target = max(current, max(recommend(o.load, policy) for o in panic_window))
        reason = "Panic"
    else:
        up = min(recommend(o.load, policy) for o in within(policy.scale_up_stabilization_seconds))
        down = max(recommend(o.load, policy)
                   for o in within(policy.scale_down_stabilization_seconds))
        if up > current:
            target, reason = up, "ScaleUp"
        elif down < current:
            if now - since < policy.scale_down_stabilization_seconds:
                target, reason = current, "WarmingUp"
            elif estimate.reported < estimate.pods:
                target, reason = current, "IncompleteMetrics"
            else:
                target, reason = down, "ScaleDown"
        else:
            target, reason = current, "Stable"

    if target > current:
        target = min(target, max_step_up(current, policy))
    bounded = clamp(target, policy)
    if bounded != target:
        reason = "Bounds"
    return (ScaleDecision(bounded, reason, summary, estimate, panic), next_state)
