"""Autoscaling replay, level (a): real kvscale replicas on the whole-platform runtime.

    flock /tmp/kvscale-bench.lock python -m bench.autoscale_replay --level a \
        [--policies kvscale,hpa-real] [--span 240]

One control plane (tests/cluster/testenv.py, with the HPA controller at a cluster's default
15 s sync period) and the process runtime (tests/cluster/kubelet.py) run every pod as a real
process: the operator from deploy/ (two pods, leader-elected), each InferenceService's router and
Redis, and its `kvscale serve` replicas of the bundled model. For each policy, in turn, on the
same arrivals (a compressed bursty trace from bench.autoscale_workloads: base rate 0.6 x one
calibrated replica's capacity, x4 from 25 % to 75 % of the span; 256-token prompts over 8 shared
128-token prefixes, 32-token answers), a fresh InferenceService starts at one replica and:

- `kvscale`: the operator's autoscaler (autoscaling.enabled, the CRD's defaults, max 3).
- `hpa-real`: autoscaling.enabled false and the real HPA of kube-controller-manager on average
  concurrency per pod (target 8, half of --max-num-seqs, as the level-(b) HPA; its own 300 s
  scale-down stabilization; max 3), read from prometheus-adapter (built from Go modules) over a
  real Prometheus (tests/cluster/custom_metrics.py): operator/hpa.py's rules and HPA.

Each request is a streamed completion sent at its arrival time to the router's pod address;
TTFT, TPOT and failures are measured at the client. Every second the benchmark reads
spec.replicas and the server pods: replica-seconds count server pods that exist (a starting pod
holds its GPU too), reversals count direction changes of spec.replicas. SLO as level (b):
TTFT <= max(1 s, 4 x the median prompt's prefill on one idle replica), TPOT <= 3 x one decode step.

All replicas share this machine's cores: a second replica adds capacity only as far as the cores
are free, unlike on GPU nodes. Say so next to any figure. Before each policy's trace, with the
policy running but held at one replica (maxReplicas 1: the HPA controller already querying the
adapter, the operator already scraping), the platform is measured for the level-(b) replay of
the same arrivals (bench.autoscale_level_b): the host's CPU in use over 10 s (the shared host's
background), a decode probe, a probe of spaced requests beside decoding streams, and a trace
probe (`bench.autoscale_workloads.probe_trace`: the trace's own arrival process from another seed,
on prefixes of its own), whose first tokens and TPOT show what the platform adds under the
trace's load; then the policy may scale up to 3 and the trace runs. With `dashboard`, Prometheus also scrapes the operator and the routers (the chart's other PodMonitors)
and the kvscale policy's run draws the chart's autoscaling dashboard from it.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.autoscale_client import (
    MODEL,
    Outcome,
    probe_decode_gaps,
    probe_ttfts,
    rounded,
    send_all,
)
from bench.autoscale_sim import Calibration
from bench.common import REPO, machine, write_result
from bench.stats import quantile
from bench.w3_sim import SimRequest

sys.path.insert(0, str(REPO / "tests" / "cluster"))

NAME = "replay"
MAX_REPLICAS = 3
HPA_TARGET_CONCURRENCY = 8  # half of --max-num-seqs 16, as level (b)'s HPA
CLUSTER_HPA_SYNC_S = 15  # kube-controller-manager's default, not the tests' 2 s
NAME_LABEL = "serving.kvscale.io/inferenceservice"
@dataclass
class Run:
    policy: str
    outcomes: list[Outcome] = field(default_factory=list)
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # t, spec, pods, ready
    background_cores: float | None = None  # the host's CPU in use before the trace (one idle replica)
    probe_gaps: list[float] | None = None  # a probe's decode steps there, alone (s)
    probe_ttfts: list[tuple[float, float | None]] | None = None  # (sent at, TTFT) of probe requests
    probe_batch: dict[str, float] | None = None  # the TTFT probe's decode: its batch and TPOT
    # (arrival, TTFT, TPOT) of the trace probe's requests
    probe_trace: list[tuple[float, float | None, float | None]] | None = None
    dashboard_empty_panels: list[str] | None = None


def host_busy_cores(seconds: float) -> float:
    """CPUs in use on this host, averaged over ``seconds`` (/proc/stat through psutil)."""
    import psutil

    def busy_and_total() -> tuple[float, float]:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = sum(t)
        return total - idle, total

    busy0, total0 = busy_and_total()
    time.sleep(seconds)
    busy1, total1 = busy_and_total()
    cores = psutil.cpu_count() or 1
    return cores * (busy1 - busy0) / max(total1 - total0, 1e-9)


def inference_service(namespace: str, policy: str, max_replicas: int = MAX_REPLICAS) -> dict[str, Any]:
    """The replayed service as ``policy`` runs it (anything but kvscale: autoscaling off)."""
    autoscaling: dict[str, Any] = ({"enabled": True, "minReplicas": 1, "maxReplicas": max_replicas}
                                   if policy == "kvscale" else {"enabled": False})
    from testenv import kwok_toleration

    return {
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"uri": f"bundled://{MODEL}"}, "replicas": 1,
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            # bench.autoscale_calibrate's ENGINE_FLAGS.
            "engine": {"maxModelLen": 1024, "maxNumSeqs": 16, "maxNumBatchedTokens": 512},
            "tolerations": [kwok_toleration()],
            "autoscaling": autoscaling,
            "router": {"replicas": 1},
        },
    }


def sample(env: Any, namespace: str, run: Run, start: float, stop: threading.Event) -> None:
    from testenv import ready_pods

    while not stop.wait(1.0):
        try:
            spec = env.kubectl_json("get", "inferenceservice", NAME, "-n", namespace)["spec"]["replicas"]
            pods = [p for p in env.kubectl_json("get", "pods", "-n", namespace, "-l",
                                                f"{NAME_LABEL}={NAME}")["items"]
                    if not p["metadata"].get("deletionTimestamp")]
            ready = len(ready_pods(env, namespace, f"{NAME_LABEL}={NAME}"))
        except Exception:  # one failed read: the next second has it
            continue
        run.timeline.append((round(time.monotonic() - start, 1), int(spec), len(pods), ready))


def render_autoscaling_dashboard(prometheus_url: str, namespace: str, start: float, end: float,
                                 path: Path) -> list[str]:
    """The chart's autoscaling dashboard over [start, end] (Unix seconds) of ``namespace``'s
    InferenceService, from the run's Prometheus; returns the panels without data."""
    from bench.dashboard_render import render_from_prometheus

    board = json.loads((REPO / "charts" / "kvscale" / "dashboards" / "autoscaling.json").read_text())
    # $__rate_interval: what Grafana sets at a 1 s scrape (the end-to-end test's value).
    values = {"namespace": namespace, "inferenceservice": NAME, "model_name": MODEL, "pod": ".*",
              "__rate_interval": "10s"}
    return render_from_prometheus(board, prometheus_url, values, start, end, path)


def apply_policy(env: Any, namespace: str, policy: str, max_replicas: int = MAX_REPLICAS) -> None:
    """Hand the InferenceService's replicas to ``policy`` (the operator's autoscaler, or the real
    HPA through prometheus-adapter), up to ``max_replicas``."""
    env.kubectl("apply", "-f", "-", input=json.dumps(inference_service(namespace, policy, max_replicas)))
    if policy == "hpa-real":
        from kvscale.operator.hpa import horizontal_pod_autoscaler

        env.kubectl("apply", "-f", "-", input=json.dumps(horizontal_pod_autoscaler(
            NAME, namespace, min_replicas=1, max_replicas=max_replicas,
            target_concurrency=HPA_TARGET_CONCURRENCY)))


def replay(env: Any, policy: str, requests: list[SimRequest], tail_s: float,
           probe_trace: list[SimRequest] | None = None,
           prometheus_url: str | None = None, dashboard: Path | None = None) -> Run:
    from testenv import ready_pods

    namespace = f"replay-{policy}"
    env.kubectl("create", "namespace", namespace)
    # The policy runs during the probes, held at one replica (the probes measure one), so that
    # they see the platform as the trace will: the HPA controller querying prometheus-adapter and
    # Prometheus every sync, or the operator scraping the replica. It may scale for the trace.
    apply_policy(env, namespace, policy, max_replicas=1)
    deadline = time.monotonic() + 600
    while not (ready_pods(env, namespace, f"{NAME_LABEL}={NAME}")
               and ready_pods(env, namespace, f"serving.kvscale.io/router={NAME}")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{namespace}: no ready server and router after 600 s")
        time.sleep(1)
    (router,) = ready_pods(env, namespace, f"serving.kvscale.io/router={NAME}")
    url = f"http://{router['status']['podIP']}:8080"
    run = Run(policy, [Outcome(r.arrival) for r in requests])
    # What the rest of the platform takes from the host's cores (control plane, operator, router,
    # Redis, Prometheus, the adapter, the idle replica): the simulator's SharedHost.background_cores.
    run.background_cores = round(host_busy_cores(10.0), 3)
    print(f"level-a {policy}: the host's background CPU {run.background_cores} cores", flush=True)
    run.probe_gaps = probe_decode_gaps(url)
    run.probe_ttfts, run.probe_batch = probe_ttfts(url)
    ttfts = [t for _, t in run.probe_ttfts if t is not None]
    print(f"level-a {policy}: probe decode steps p50/p90/p99 {quantile(run.probe_gaps, 0.5):.4f}/"
          f"{quantile(run.probe_gaps, 0.9):.4f}/{quantile(run.probe_gaps, 0.99):.4f} s, "
          f"TTFT p50/p90 {quantile(ttfts, 0.5):.3f}/{quantile(ttfts, 0.9):.3f} s, decode beside them "
          f"{run.probe_batch}", flush=True)
    if probe_trace:
        outcomes = [Outcome(r.arrival) for r in probe_trace]
        send_all(url, probe_trace, outcomes)
        run.probe_trace = [(round(o.arrival, 3), rounded(o.ttft), rounded(o.tpot)) for o in outcomes]
        ttfts = [o.ttft for o in outcomes if o.ttft is not None]
        print(f"level-a {policy}: trace probe ({len(probe_trace)} requests) TTFT p50/p90 "
              f"{quantile(ttfts, 0.5):.3f}/{quantile(ttfts, 0.9):.3f} s, "
              f"{len(outcomes) - len(ttfts)} failed", flush=True)
        time.sleep(2.0)  # its last streams closed
    apply_policy(env, namespace, policy, max_replicas=MAX_REPLICAS)
    stop = threading.Event()
    start = time.monotonic()
    wall_start = time.time()
    sampler = threading.Thread(target=sample, args=(env, namespace, run, start, stop), daemon=True)
    sampler.start()
    send_all(url, requests, run.outcomes)
    time.sleep(tail_s)
    stop.set()
    sampler.join(10)
    if dashboard is not None and prometheus_url is not None:
        try:
            run.dashboard_empty_panels = render_autoscaling_dashboard(
                prometheus_url, namespace, wall_start, time.time(), dashboard)
            print(f"level-a {policy}: dashboard {dashboard}, panels without data: "
                  f"{run.dashboard_empty_panels}", flush=True)
        except Exception as exc:  # the picture is secondary: the figures still count
            print(f"level-a {policy}: dashboard not rendered: {type(exc).__name__}: {exc}", flush=True)
    env.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=300s", check=False)
    return run


def figures(run: Run, span_s: float, ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    done = [o for o in run.outcomes if o.error is None]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    within = [o for o in done if o.ttft is not None and o.ttft <= ttft_slo
              and (o.tpot or 0.0) <= tpot_slo]
    # Replica-seconds over the trace's span (the same window for every policy).
    seconds = 0.0
    for (t0, _, pods, _), (t1, _, _, _) in zip(run.timeline, run.timeline[1:], strict=False):
        if t0 < span_s:
            seconds += pods * (min(t1, span_s) - t0)
    specs = [spec for _, spec, _, _ in run.timeline]
    moves = [b - a for a, b in zip(specs, specs[1:], strict=False) if b != a]
    reversals = sum(1 for a, b in zip(moves, moves[1:], strict=False) if (a > 0) != (b > 0))
    ups = [t for (t, spec, _, _), prev in zip(run.timeline[1:], specs, strict=False) if spec > prev]
    return {
        "requests": len(run.outcomes), "failed": len(run.outcomes) - len(done),
        "errors": sorted({o.error for o in run.outcomes if o.error})[:5],
        "slo_attainment": len(within) / len(run.outcomes),
        "ttft_p50_s": quantile(ttfts, 0.5) if ttfts else None,
        "ttft_p90_s": quantile(ttfts, 0.9) if ttfts else None,
        "tpot_p50_s": statistics.median([o.tpot for o in done if o.tpot is not None]) if done else None,
        "replica_seconds": round(seconds, 1),
        "max_replicas": max(specs) if specs else None,
        "reversals": reversals,
        "reversals_per_hour": reversals * 3600 / span_s,
        "first_scale_up_s": ups[0] if ups else None,
        "background_cores": run.background_cores,
        "probe": {"decode_gaps_s": run.probe_gaps, "ttft": run.probe_ttfts, "decode_at_batch": run.probe_batch,
                  "trace": run.probe_trace},
        "dashboard_empty_panels": run.dashboard_empty_panels,
        "timeline": run.timeline,
        # Each request as the client saw it, in arrival order: (arrival s, TTFT s, TPOT s), None
        # where it failed; level (b)'s replay keeps the same per request, to compare by phase.
        "per_request": [(round(o.arrival, 3), rounded(o.ttft), rounded(o.tpot)) for o in run.outcomes],
    }


def run_level_a(policies: list[str], requests: list[SimRequest], calibration: Calibration,
                ttft_slo: float, tpot_slo: float, workdir: Path, tail_s: float = 20.0,
                dashboard: Path | None = None, probe_trace: list[SimRequest] | None = None) -> dict[str, Any]:
    """Each policy in turn on ``requests``; ``dashboard``: the kvscale run's autoscaling dashboard
    drawn there from the run's Prometheus (which then also scrapes the operator and routers);
    ``probe_trace``: arrivals sent before each trace on one replica (`replay`)."""
    from custom_metrics import start_custom_metrics
    from kubelet import start_runtime
    from testenv import (
        CPU_NODE_NAME,
        FAKE_NODE_NAME,
        find_or_build_bins,
        find_or_build_prometheus_adapter,
        start_env,
        stop_env,
    )

    span = requests[-1].arrival
    env = start_env(workdir / "env", find_or_build_bins(), process_pods=True,
                    hpa_sync_period_s=CLUSTER_HPA_SYNC_S)
    runtime = metrics = None
    results: dict[str, Any] = {}
    try:
        runtime = start_runtime(env, workdir / "kubelet", (FAKE_NODE_NAME, CPU_NODE_NAME))
        env.kubectl("apply", "-f", str(REPO / "crds"), "-f", str(REPO / "deploy" / "rbac.yaml"))
        env.kubectl("apply", "-f", str(REPO / "deploy" / "operator.yaml"))
        if "hpa-real" in policies or dashboard is not None:
            metrics = start_custom_metrics(env, runtime, workdir / "custom-metrics",
                                           find_or_build_prometheus_adapter(),
                                           platform=dashboard is not None)
        for policy in policies:
            began = time.monotonic()
            run = replay(env, policy, requests, tail_s, probe_trace=probe_trace,
                         prometheus_url=metrics.prometheus_url if metrics else None,
                         dashboard=dashboard if policy == "kvscale" else None)
            results[policy] = figures(run, span, ttft_slo, tpot_slo)
            results[policy]["wall_s"] = round(time.monotonic() - began, 1)
            r = results[policy]
            print(f"level-a {policy:9s} SLO {r['slo_attainment']:.3f} TTFT p50/p90 "
                  f"{r['ttft_p50_s']}/{r['ttft_p90_s']} replica-s {r['replica_seconds']} "
                  f"failed {r['failed']} reversals {r['reversals']} max {r['max_replicas']} "
                  f"first up {r['first_scale_up_s']}", flush=True)
    finally:
        if metrics is not None:
            metrics.stop()
        if runtime is not None:
            runtime.stop()
        stop_env(env, keep_logs=True)
    return {"level": "a (real replicas on the whole-platform runtime)", "span_s": span,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "hpa_sync_period_s": CLUSTER_HPA_SYNC_S,
            "max_replicas": MAX_REPLICAS, "hpa_target_concurrency": HPA_TARGET_CONCURRENCY,
            "calibration": calibration.__dict__, "policies": results}


def write(out: dict[str, Any], path: str | None) -> Path:
    return write_result("autoscale_replay_level_a", {"benchmark": "autoscale_replay", **out}, path)
