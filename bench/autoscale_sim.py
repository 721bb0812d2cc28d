"""A fleet of simulated replicas under an autoscaling policy: the level-(b) model of
the autoscaling benchmark (docs/performance.md, "Autoscaling").

Each replica is `bench.w3_sim.SimReplica` (continuous batching, a token budget per step,
an LRU prefix cache of the real pool's size), costed by a `Calibration` measured once on a real
`kvscale serve` of the bundled model (`bench.autoscale_replay --calibrate`). The fleet adds:
replicas that are ready a measured cold start after they are asked for; a router over the ready
replicas that holds requests while none is ready (503 past the hold limit: a failed request);
scale-in that drains a removed replica (its open requests finish; they are counted as "on removed
pods"). The router is kvscale's own by default, the same for every policy (all of them would run
behind it): `bench.w3_sim_router.SimRouter`, the real decision functions of `kvscale.router.policy`
with the router's default policy, fed each replica's queued prefill, decodes, prefix matches from
an index that predicts a sent prompt's blocks for 10 s. `router="fewest-open"` is the earlier
stand-in: the ready replica with the fewest open requests.

`host` (a `SharedHost`, default None: every replica has its own compute, as on GPU nodes) models
replicas that share one host's cores, as level (a) runs them on a CPU machine: each tick, the CPU
wanted by the replicas stepping, the replicas starting (a cold start loads and warms the model on
the same cores) and the rest of the platform is set against the host's cores, and every step and
every cold start in progress is stretched (`host_slowdown`, `start_slowdown`). The hour-long
level-(b) replays keep independent replicas.

The policies, each observing what it would observe in a cluster, are bench.autoscale_policies'.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from bench.autoscale_policies import FleetView, Pod
from bench.w3_sim import Costs, SimReplica, SimRequest
from bench.w3_sim_router import SimRouter
from kvscale.router.policy import DEFAULT_POLICY

FEWEST_OPEN = "fewest-open"  # the earlier stand-in for the router


@dataclass(frozen=True)
class Calibration:
    """One real replica's measured figures."""

    prefill_tokens_per_s: float
    decode_step_s: float  # one decode step of one sequence
    kv_blocks: int
    block_size: int
    max_num_seqs: int
    step_tokens: int
    cold_start_s: float  # process start to /health 200 (model load and warm-up)
    # What each decoding sequence beyond the first adds to a step, fitted from steps measured at
    # several batch sizes (older calibrations have none: 0)
    decode_step_per_seq_s: float = 0.0


@dataclass(frozen=True)
class SharedHost:
    """Replicas sharing one host's cores, each figure measured on that host
    (`bench.autoscale_replay --calibrate`)."""

    cores: float  # the host's CPUs
    busy_cores: float  # CPU one replica uses while it steps (CPU-s per wall s, alone on the host)
    start_cores: float  # CPU a replica uses during its cold start (same, process start to ready)
    background_cores: float = 0.0  # what the rest of the platform uses (control plane, router...)
    # Contention beyond a fair share of the cores: an OpenMP pool whose threads are descheduled
    # waits at every barrier for them, so two replicas on the same cores can each run at less than
    # half speed. Fitted from two busy replicas: slowdown = (demand / cores) ** exponent.
    exponent: float = 1.0
    # What a cold start costs a stepping replica, in cores of demand, when that differs from its
    # CPU use (fitted from a step measured while a replica starts: `start_pressure`); None: its
    # CPU use, start_cores.
    start_pressure_cores: float | None = None
    # How much one step's time varies on that host beside the rest of the platform (scrapes,
    # controllers, the router's hops): decode steps measured there, each over the step this model
    # expects there (`bench.autoscale_level_b.with_step_factors`). Each simulated step's time is
    # multiplied by one drawn from them (seeded); () for none.
    step_factors: tuple[float, ...] = ()


def host_slowdown(host: SharedHost, stepping: int, starting: int) -> float:
    """How much longer a step takes than alone on an idle host, with ``stepping`` replicas
    stepping and ``starting`` replicas in their cold start on ``host``. Alone means the
    calibration's conditions: one replica stepping and nothing else, which the host runs at full
    speed as long as the demand fits its cores."""
    start = host.start_cores if host.start_pressure_cores is None else host.start_pressure_cores
    demand = stepping * host.busy_cores + starting * start + host.background_cores
    if demand <= host.cores:
        return 1.0
    return (demand / host.cores) ** host.exponent


def start_slowdown(host: SharedHost, stepping: int, starting: int) -> float:
    """How much longer a second of cold start takes than alone: a fair share of the cores (a
    model load reads, converts and compiles; it has no barrier to wait at)."""
    demand = stepping * host.busy_cores + starting * host.start_cores + host.background_cores
    return max(1.0, demand / host.cores)


def start_pressure(host: SharedHost, slowdown_during_start: float) -> float:
    """The `SharedHost.start_pressure_cores` that makes `host_slowdown` with one replica stepping
    and one starting give ``slowdown_during_start`` (measured); never below its CPU use."""
    fitted = host.cores * slowdown_during_start ** (1.0 / host.exponent) - host.busy_cores \
        - host.background_cores
    return max(host.start_cores, fitted)


def contention_exponent(cores: float, busy_cores: float, two_busy_slowdown: float) -> float:
    """The `SharedHost.exponent` that makes `host_slowdown` give the slowdown measured with two
    replicas stepping at once (1.0, a fair share, when the two fit the cores or the measurement
    shows no more than a fair share's slowdown)."""
    ratio = 2 * busy_cores / cores
    if ratio <= 1.0 or two_busy_slowdown <= 1.0:
        return 1.0
    return max(1.0, math.log(two_busy_slowdown) / math.log(ratio))


@dataclass
class Outcome:
    requests: list[SimRequest]
    failed: int
    replica_seconds: float
    decisions: list[tuple[float, int, int]]  # (time, from, to)
    on_removed: int  # requests open on a pod when it was picked for removal
    timeline: list[tuple[float, int, int, int]]  # (time, replicas wanted, ready, open requests)
    replica_seconds_window: float = 0.0  # replica-seconds before `simulate`'s count_until


# -- the fleet ----------------------------------------------------------------------------------

@dataclass
class Fleet:
    calibration: Calibration
    hold_timeout_s: float
    router: str = DEFAULT_POLICY  # a kvscale.router.policy name, or FEWEST_OPEN
    host: SharedHost | None = None  # None: each replica has its own compute
    tick_s: float = 0.05
    pods: list[Pod] = field(default_factory=list)
    removed: list[Pod] = field(default_factory=list)
    held: deque[SimRequest] = field(default_factory=deque)
    failed: int = 0
    on_removed: int = 0
    _names: int = 0
    _router: SimRouter | None = None
    _jitter: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        if self.router != FEWEST_OPEN:
            self._router = SimRouter(self.router, [], self.calibration.block_size, seed=0)

    def costs(self) -> Costs:
        c = self.calibration
        return Costs(c.prefill_tokens_per_s, c.decode_step_s, c.step_tokens, c.max_num_seqs,
                     c.decode_step_per_seq_s)

    def add(self, now: float, cold: bool = True) -> None:
        self._names += 1
        replica = SimReplica(self._names, self.calibration.kv_blocks, self.calibration.block_size,
                             self.costs())
        if self._router is not None:
            replica.on_stored = self._router.stored  # its KV events reach the router's index
        start = self.calibration.cold_start_s if cold else 0.0
        # On a shared host the cold start runs at the host's pace: ready once it has run out.
        ready = now + start if self.host is None or not cold else math.inf
        self.pods.append(Pod(f"pod-{self._names}", replica, now, ready, start_left=start))

    def remove(self, now: float, pod: Pod) -> None:
        pod.removed_at = now
        self.on_removed += pod.open_requests()
        self.pods.remove(pod)
        self.removed.append(pod)

    def route(self, now: float, request: SimRequest) -> None:
        ready = [p for p in self.pods if p.ready(now)]
        if not ready:
            self.held.append(request)
            return
        if self._router is None:
            pod = min(ready, key=lambda p: (p.open_requests(), p.name))
        else:
            self._router.replicas = [p.replica for p in ready]
            chosen = self._router.route(request, now)
            pod = next(p for p in ready if p.replica.index == chosen)
        request.replica = pod.replica.index
        pod.replica.waiting.append(request)

    def release_held(self, now: float) -> None:
        while self.held and now - self.held[0].arrival > self.hold_timeout_s:
            self.held.popleft()
            self.failed += 1
        if self.held and any(p.ready(now) for p in self.pods):
            while self.held:
                self.route(now, self.held.popleft())

    def slowdown(self, now: float) -> tuple[float, float]:
        """The shared host's slowdown over the tick from ``now`` of a step and of a cold start
        (1.0 without a shared host)."""
        if self.host is None:
            return 1.0, 1.0
        live = [*self.pods, *self.removed]
        starting = sum(1 for p in self.pods if not p.ready(now))
        stepping = sum(1 for p in live if (p.removed_at is not None or p.ready(now))
                       and (p.busy_until > now or p.replica.waiting or p.replica.running))
        return (host_slowdown(self.host, stepping, starting),
                start_slowdown(self.host, stepping, starting))

    def step_factor(self) -> float:
        """One step's variation on the shared host (`SharedHost.step_factors`), 1.0 without."""
        if self.host is None or not self.host.step_factors:
            return 1.0
        return self._jitter.choice(self.host.step_factors)

    def run_pods(self, until: float) -> float:
        """Every pod's engine steps up to ``until``; returns the time of the last finish."""
        last = -1.0
        slowdown, start = self.slowdown(until - self.tick_s)
        if self.host is not None:
            for pod in self.pods:
                if pod.ready_at == math.inf:
                    pod.start_left -= self.tick_s / start
                    if pod.start_left <= 0:
                        pod.ready_at = until
        for pod in [*self.pods, *self.removed]:
            if (pod.removed_at is None and until < pod.ready_at) or pod.ready_at == math.inf:
                continue  # still starting (a pod removed before it was ready never runs)
            replica = pod.replica
            pod.busy_until = max(pod.busy_until, pod.ready_at)
            while pod.busy_until < until and (replica.waiting or replica.running):
                pod.slowdown = slowdown
                pod.busy_until, _, done = replica.step(pod.busy_until, slowdown * self.step_factor())
                if done:
                    last = max(last, max(r.finished or 0.0 for r in done))
            if pod.busy_until < until:
                pod.busy_until = until
        self.removed = [p for p in self.removed if p.replica.waiting or p.replica.running]
        return last

    def open_requests(self) -> int:
        return len(self.held) + sum(p.open_requests() for p in [*self.pods, *self.removed])


def simulate(requests: list[SimRequest], policy, calibration: Calibration, *, start_replicas: int,
             hold_timeout_s: float, end: float | None = None, router: str = DEFAULT_POLICY,
             host: SharedHost | None = None, count_until: float | None = None) -> Outcome:
    """Replay ``requests`` (sorted by arrival) through a fleet scaled by ``policy``; ``host``:
    replicas sharing one host's cores; ``count_until``: also count replica-seconds up to then
    (level (a) counts them over the trace's span)."""
    requests = [replace(r, pinned=[]) for r in requests]  # a fresh copy: pinned is mutated
    fleet = Fleet(calibration, hold_timeout_s, router, host)
    for _ in range(start_replicas):
        fleet.add(0.0, cold=False)
    wanted = start_replicas
    decisions: list[tuple[float, int, int]] = []
    timeline: list[tuple[float, int, int, int]] = []
    horizon = end if end is not None else requests[-1].arrival + 120.0
    next_request, next_policy, last_activity = 0, 0.0, 0.0
    replica_seconds = window = 0.0
    now = 0.0
    while now < horizon or fleet.open_requests():
        while next_request < len(requests) and requests[next_request].arrival <= now:
            fleet.route(now, requests[next_request])
            last_activity = now
            next_request += 1
        fleet.release_held(now)
        finished = fleet.run_pods(now + fleet.tick_s)
        if finished >= 0:
            last_activity = max(last_activity, finished)
        if fleet.open_requests():
            last_activity = now
        if now >= next_policy:
            next_policy = now + policy.period_s
            view = FleetView(now, fleet.pods, len(fleet.held), now - last_activity, wanted)
            target = policy.desired(view)
            if target != wanted:
                decisions.append((now, wanted, target))
            while len(fleet.pods) < target:
                fleet.add(now)
            while len(fleet.pods) > target:
                fleet.remove(now, policy.victim(fleet.pods))
            wanted = target
            timeline.append((now, wanted, sum(p.ready(now) for p in fleet.pods), fleet.open_requests()))
        # A pod costs from the moment it is asked for until it is gone (drained after removal).
        replica_seconds += fleet.tick_s * (len(fleet.pods) + len(fleet.removed))
        if count_until is not None and now < count_until:
            window += min(fleet.tick_s, count_until - now) * (len(fleet.pods) + len(fleet.removed))
        now += fleet.tick_s
        if now > horizon + 3600:
            break
    return Outcome(requests, fleet.failed, replica_seconds, decisions, fleet.on_removed, timeline,
                   window)


def reversals(decisions: list[tuple[float, int, int]]) -> int:
    """Changes of scaling direction (up then down, or down then up)."""
    directions = [1 if to > frm else -1 for _, frm, to in decisions]
    return sum(1 for a, b in zip(directions, directions[1:], strict=False) if a != b)


def tpot(request: SimRequest) -> float | None:
    """Time per output token after the first; None for a request unserved or of one token."""
    if request.first_token is None or request.finished is None or request.output_tokens < 2:
        return None
    return (request.finished - request.first_token) / (request.output_tokens - 1)


def report(outcome: Outcome, ttft_slo_s: float, tpot_slo_s: float, span_s: float) -> dict:
    served = [r for r in outcome.requests if r.finished is not None and r.first_token is not None]
    ttfts = sorted(r.first_token - r.arrival for r in served)  # type: ignore[operator]
    tpots = [tpot(r) or 0.0 for r in served]
    within = sum(1 for r, tpot in zip(served, tpots, strict=True)
                 if r.first_token - r.arrival <= ttft_slo_s and tpot <= tpot_slo_s)  # type: ignore[operator]
    # Which half of the SLO the served misses broke: TTFT is the scaler's and the router's to
    # keep; TPOT also depends on the prefill chunks the engine interleaves with decodes.
    late = [r.first_token - r.arrival > ttft_slo_s for r in served]  # type: ignore[operator]
    slow = [tpot > tpot_slo_s for tpot in tpots]
    total = len(outcome.requests)

    def q(values: list[float], p: float) -> float:
        return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")

    return {
        "requests": total,
        "slo_attainment": within / total if total else float("nan"),
        "ttft_p50_s": q(ttfts, 0.5), "ttft_p90_s": q(ttfts, 0.9), "ttft_p99_s": q(ttfts, 0.99),
        "missed_ttft_only": sum(a and not b for a, b in zip(late, slow, strict=True)),
        "missed_tpot_only": sum(b and not a for a, b in zip(late, slow, strict=True)),
        "missed_both": sum(a and b for a, b in zip(late, slow, strict=True)),
        "tpot_p50_s": q(sorted(tpots), 0.5),
        "replica_seconds": outcome.replica_seconds,
        "failed": outcome.failed + (total - len(served) - outcome.failed),
        "reversals_per_hour": reversals(outcome.decisions) * 3600.0 / span_s,
        "scale_decisions": len(outcome.decisions),
        "requests_on_removed_pods": outcome.on_removed,
    }
