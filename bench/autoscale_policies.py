"""The autoscaling policies of the simulated fleet (bench.autoscale_sim), and the pods they
observe. Policies, each observing what it would observe in a cluster, on its own period:

- `kvscale`: the operator's own rule, `kvscale.operator.scaling.decide`, imported (never
  restated), fed PodLoads built from the replicas as their /metrics would report them (active KV
  blocks, waiting, running, prompt tokens still to compute, the prefill rate once the replica has
  prefilled) and the router's Demand (held requests, idle time); scale-in removes the pod with the lowest
  `kvscale.operator.deletion_cost.pod_cost`.
- `hpa-concurrency`: the HorizontalPodAutoscaler's documented algorithm on average concurrency per
  pod (running + waiting), 15 s sync, tolerance 0.1, 300 s scale-down stabilization, scale-up at
  most max(100 %, 4 pods) per 15 s; scale-in removes the newest pod (the ReplicaSet's default
  without deletion costs).
- `keda-queue`: KEDA's scaler on `vllm:num_requests_waiting` with target 5 per pod (an HPA
  AverageValue metric: desired = ceil(total waiting / 5)), same HPA behaviour.
- `kpa-kv`: Knative's KPA as AIBrix applies it to KV usage: every 2 s, desired = ceil(mean over
  the 60 s stable window of total KV usage / target), panic when the 6 s window asks for 2x the
  ready pods (no scale-down while panicking).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from bench.w3_sim import SimReplica
from kvscale.operator import scaling
from kvscale.operator.deletion_cost import pod_cost
from kvscale.operator.spec import AutoscalingPolicy


@dataclass
class Pod:
    name: str
    replica: SimReplica
    asked_at: float
    ready_at: float
    removed_at: float | None = None
    busy_until: float = 0.0
    start_left: float = 0.0  # on a shared host: seconds of cold start still to run, at full speed
    slowdown: float = 1.0  # the host's slowdown at its last step (its measured rates show it)

    def ready(self, now: float) -> bool:
        return self.removed_at is None and now >= self.ready_at

    def open_requests(self) -> int:
        return self.replica.load()


def prefill_tokens_waiting(replica: SimReplica) -> int:
    """As the engine reports it (server/engine/engine_stats.py): a waiting prompt less the prefix its
    cache holds now, plus what running requests have still to prefill."""
    waiting = sum(max(r.prompt_tokens - replica._cached_prefix(r) * replica.block_size, 1)
                  for r in replica.waiting)
    return waiting + sum(r.to_prefill for r in replica.running)


@dataclass
class FleetView:
    now: float
    pods: list[Pod]  # not removed (ready or starting)
    held: int
    idle_seconds: float
    current: int  # replicas wanted so far


class KvscalePolicy:
    period_s = 5.0  # the operator's --scrape-interval in deploy/operator.yaml

    def __init__(self, policy: AutoscalingPolicy) -> None:
        self.name = "kvscale"
        self.policy = policy
        self.state = scaling.AutoscalerState()

    def desired(self, view: FleetView) -> int:
        loads = [scaling.PodLoad(p.name, kv_blocks_active=float(len(p.replica.refs)),
                                 kv_blocks_total=float(p.replica.num_blocks),
                                 num_requests_waiting=float(len(p.replica.waiting)),
                                 num_requests_running=float(len(p.replica.running)),
                                 max_num_seqs=float(p.replica.costs.max_num_seqs),
                                 prefill_tokens_waiting=float(prefill_tokens_waiting(p.replica)),
                                 # A replica measures its rate once it has prefilled something.
                                 # (on a shared host, what it ran at lately)
                                 prefill_tokens_per_s=(p.replica.costs.prefill_tokens_per_s / p.slowdown
                                                       if p.replica.cache else 0.0))
                 for p in view.pods if p.ready(view.now)]
        decision, self.state = scaling.decide(
            view.now, loads, view.current, self.policy, self.state,
            scaling.Demand(held=view.held, idle_seconds=view.idle_seconds))
        return decision.replicas

    def victim(self, pods: list[Pod]) -> Pod:
        # The ReplicaSet removes the lowest pod-deletion-cost first: the operator's own cost.
        return min(pods, key=lambda p: pod_cost(len(p.replica.refs), len(p.replica.cache)))


class HpaPolicy:
    """HPA (autoscaling/v2) on one metric, as its documentation gives the algorithm."""

    period_s = 15.0
    tolerance = 0.1
    down_window_s = 300.0

    def __init__(self, name: str, metric: str, target: float, min_replicas: int,
                 max_replicas: int) -> None:
        self.name = name
        self.metric = metric  # "concurrency" (per-pod average) or "waiting" (total / target)
        self.target = target
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.recommendations: deque[tuple[float, int]] = deque()

    def desired(self, view: FleetView) -> int:
        ready = [p for p in view.pods if p.ready(view.now)]
        current = view.current
        if not ready:
            proposal = current
        elif self.metric == "concurrency":
            average = sum(p.open_requests() for p in ready) / len(ready)
            ratio = average / self.target
            proposal = current if abs(ratio - 1) <= self.tolerance else math.ceil(len(ready) * ratio)
        else:
            total = sum(len(p.replica.waiting) for p in ready) + view.held
            ratio = total / (self.target * len(ready))
            proposal = current if abs(ratio - 1) <= self.tolerance else math.ceil(total / self.target)
        proposal = max(self.min_replicas, min(self.max_replicas, proposal))
        self.recommendations.append((view.now, proposal))
        while self.recommendations and view.now - self.recommendations[0][0] > self.down_window_s:
            self.recommendations.popleft()
        if proposal < current:  # scale-down stabilization: the highest of the window
            proposal = min(current, max(r for _, r in self.recommendations))
        if proposal > current:  # default scale-up policy: +100 % or +4 pods per period
            proposal = min(proposal, max(2 * current, current + 4))
        return proposal

    def victim(self, pods: list[Pod]) -> Pod:
        return max(pods, key=lambda p: p.asked_at)  # newest first, without deletion costs


class KpaPolicy:
    """Knative's KPA on total KV usage (AIBrix's KPA on `gpu_cache_usage_perc`)."""

    name = "kpa-kv"
    period_s = 2.0
    stable_s = 60.0
    panic_s = 6.0
    panic_threshold = 2.0

    def __init__(self, target: float, min_replicas: int, max_replicas: int) -> None:
        self.target = target
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.samples: deque[tuple[float, float]] = deque()
        self.panic_until = -1.0

    def desired(self, view: FleetView) -> int:
        ready = [p for p in view.pods if p.ready(view.now)]
        usage = sum(p.replica.kv_usage() for p in ready)
        self.samples.append((view.now, usage))
        while self.samples and view.now - self.samples[0][0] > self.stable_s:
            self.samples.popleft()
        stable = statistics.mean(u for _, u in self.samples)
        panic = statistics.mean(u for t, u in self.samples if view.now - t <= self.panic_s)
        want_stable = math.ceil(stable / self.target - 1e-9)
        want_panic = math.ceil(panic / self.target - 1e-9)
        if ready and want_panic >= self.panic_threshold * len(ready):
            self.panic_until = view.now + self.stable_s
        if view.now < self.panic_until:
            want = max(view.current, want_panic)
        else:
            want = want_stable
        return max(self.min_replicas, min(self.max_replicas, want))

    def victim(self, pods: list[Pod]) -> Pod:
        return max(pods, key=lambda p: p.asked_at)
