"""Autoscaling policies replayed on the same arrivals, level (b): the simulated fleet of
`bench.autoscale_sim`, calibrated from one real replica of the bundled model.

    flock /tmp/kvscale-bench.lock python -m bench.autoscale_replay --calibrate   # real replica
    python -m bench.autoscale_replay            # bench/results/autoscale_replay.json + .png

`--calibrate` starts a real `kvscale serve` (the platform tests' engine flags) and measures, on
this machine: the cold start (process start to /health 200, the model load and warm-up), the KV
pool (`kvscale:kv_blocks_total`), the prefill rate (a 480-token prompt's time to first token) and
a decode step (a 64-token answer's time after its first token), each the median of 3 runs, and
the decode step at batches of 4, 8 and 16 streams decoding at once (the cost each sequence beyond
the first adds to a step, `Calibration.decode_step_per_seq_s`, is their slope); then
what sharing the host's cores costs (`autoscale_sim.SharedHost`): the CPU the replica used during
its cold start and while decoding, its decode step while a second replica starts, and both
decoding at once. It writes `--calibration` (default bench/results/autoscale_calibration.json,
which the level-(b) figures of docs/performance.md "Autoscaling" quote: give a new path for a new measurement);
the replay reads it. With `--workloads ''` it stops there.

Workloads (the scaling is written next to every figure in the JSON and docs/performance.md):

- `mooncake`: the Mooncake conversation trace (../shared/data/traces/), the whole hour in real
  time (a simulation needs no compression), each 512-token hash block mapped to one 16-token KV
  block (tokens / 32, the prefix sharing kept), outputs / 16 (at least 1 token).
- `bursty`: synthetic, 900 s: a base rate of 0.6 x one calibrated replica's capacity, steps x4
  up at 60 s and down at 240 s, again up at 420 s and down at 480 s, then a diurnal ramp
  (1 + 3 sin^2) to the end; 8 shared 128-token prefixes, 256-token prompts, 32-token answers.
- `idle`: 1800 s, a burst of 6 requests every 300 s and nothing between (kvscale with
  minReplicas 0, scaleToZeroAfterSeconds 60; the others cannot go below one replica).

Policies (bench.autoscale_sim): kvscale (the operator's rule, imported), hpa-concurrency,
keda-queue, kpa-kv, and the HPA and KEDA rules at tighter targets (`HPA_TUNED_TARGETS`,
`KEDA_TUNED_TARGETS`: "at equal attainment" sets kvscale's replica-seconds against what the
baseline's settings would spend at kvscale's attainment, `at_equal_attainment`), all behind the
same router (kvscale's own decision functions by default, `--router`). SLO: TTFT within max(1 s, 4 x the median prompt's prefill time on one idle
replica) and TPOT within 3 x one decode step. The real HPA of kube-controller-manager through
prometheus-adapter is a policy of level (a) only: `--level a` (bench.autoscale_platform) replays
a compressed bursty trace on real replicas on the whole-platform runtime, policies `kvscale` and
`hpa-real`:

    flock -x /tmp/kvscale-bench.lock python -m bench.autoscale_replay --level a \
        --calibration bench/results/autoscale_calibration_host_epyc_1128.json --span 240 \
        --policies hpa-real,kvscale --step-load 0.3 --dashboard docs/images/dashboard-autoscaling-replay.png

then replays the same arrivals in the simulator (level (b)) with the same policies and settings
(`hpa-real`: the simulator's HPA at the real controller's 15 s sync, tolerance 0.1, 300 s
scale-down stabilization, target 8), on replicas that share the host's cores as level (a)'s do
(`SharedHost`, from the calibration, with what level (a) measured on the platform just before
each trace: the background CPU, a probe's decode steps alone through the router (the simulated
steps vary as they did: `SharedHost.step_factors`), and the trace probe, the trace's own
arrival process from another seed (`probe_trace`): the platform's cost per decoding stream,
fitted to its TPOT, and what the platform added to its first tokens, drawn for each simulated
request. Results from before the trace probe take both from the spaced TTFT probe beside three
decoding streams, which is also replayed beside it for comparison), and prints (a) against (b):
TTFT p90 and replica-seconds over the span, their ratios and whether each is within +-15 %
(TPOT p50 and SLO attainment beside them). `--step-load` sets the x4 step's rate in units of
one calibrated replica's capacity (its base is a quarter of that); `--compare-only
LEVEL_A_JSON` redoes only the (b) side against an earlier level-(a) result.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.autoscale_calibrate import CALIBRATION, calibrate, load_calibration
from bench.autoscale_level_b import level_a
from bench.autoscale_policies import HpaPolicy, KpaPolicy, KvscalePolicy
from bench.autoscale_sim import FEWEST_OPEN, Calibration, report, simulate
from bench.autoscale_workloads import WORKLOADS, attainable_ttft_share, slo
from bench.common import RESULTS, exit_on_sigterm, machine, write_result
from bench.roofline import cpu_isa
from bench.w3_sim import SimRequest
from kvscale.operator.spec import AutoscalingPolicy
from kvscale.router.policy import DEFAULT_POLICY

MAX_REPLICAS = 16


def policies(workload: str, calibration: Calibration):
    to_zero = workload == "idle"
    kvscale = AutoscalingPolicy(enabled=True, min_replicas=0 if to_zero else 1,
                                max_replicas=MAX_REPLICAS, scale_to_zero_after_seconds=60)
    concurrency_target = calibration.max_num_seqs / 2
    # The rule without its prefill term (the queue in requests only: the rule as it was before that term),
    # and its sensitivity to targetPrefillSeconds (1 s is the CRD's default), same everything else.
    before = KvscalePolicy(replace(kvscale, target_prefill_seconds=math.inf))
    before.name = "kvscale-requests-only"
    variants = [before]
    for seconds in (0.5, 2.0, 4.0):
        variant = KvscalePolicy(replace(kvscale, target_prefill_seconds=seconds))
        variant.name = f"kvscale-prefill{seconds:g}s"
        variants.append(variant)
    # Its occupancy target tightened as HPA's and KEDA's are below (the CRD's default 0.7): each
    # setting is set against the baselines' at its own attainment too.
    for usage in KVSCALE_TUNED_KV_USAGE:
        variant = KvscalePolicy(replace(kvscale, target_kv_usage=usage))
        variant.name = f"kvscale-kv{usage:g}"
        variants.append(variant)
    # The baselines at tighter targets too, as their users would tune them for a higher
    # attainment: the replica-seconds each would spend at kvscale's attainment come from these.
    tuned = [HpaPolicy(f"hpa-concurrency{target:g}", "concurrency", target, 1, MAX_REPLICAS)
             for target in HPA_TUNED_TARGETS]
    tuned += [HpaPolicy(f"keda-queue{target:g}", "waiting", target, 1, MAX_REPLICAS)
              for target in KEDA_TUNED_TARGETS]
    return [
        KvscalePolicy(kvscale),
        *variants,
        HpaPolicy("hpa-concurrency", "concurrency", concurrency_target, 1, MAX_REPLICAS),
        HpaPolicy("keda-queue", "waiting", 5.0, 1, MAX_REPLICAS),
        KpaPolicy(0.7, 1, MAX_REPLICAS),
        *tuned,
    ]


HPA_TUNED_TARGETS = (6.0, 4.0, 2.0, 1.0)  # average concurrency per pod (the default run: 8)
KEDA_TUNED_TARGETS = (2.0, 1.0)  # waiting requests per pod (the default run: 5)
KVSCALE_TUNED_KV_USAGE = (0.5, 0.35, 0.25, 0.15)  # targetKVUsage (the default: 0.7)


def at_equal_attainment(policies: dict[str, dict], family: str, ours: str = "kvscale") -> dict:
    """kvscale's replica-seconds (policy ``ours``: its defaults or one of its settings) over what
    ``family`` (a baseline's name prefix: its default and its tuned targets) would spend at that
    SLO attainment: its settings as points (attainment, replica-seconds), linearly between a
    setting attaining at most as much and one attaining at least as much, the cheapest such pair.
    ``ratio`` None where kvscale's attainment is outside the settings' range (``reason`` says
    which side; nothing is extrapolated)."""
    kv = policies[ours]
    target = kv["slo_attainment"]
    points = [(f["slo_attainment"], f["replica_seconds"], name) for name, f in policies.items()
              if name == family or (name.startswith(family) and name[len(family):][:1].isdigit())]
    below = [p for p in points if p[0] <= target]
    above = [p for p in points if p[0] >= target]
    span = {"range": [min(p[0] for p in points), max(p[0] for p in points)]}
    if not below:
        return {"ratio": None, "reason": "kvscale attains less than every setting", **span}
    if not above:
        return {"ratio": None, "reason": "no setting reaches kvscale's attainment", **span}

    def between(low: tuple, high: tuple) -> float:
        if high[0] == low[0]:
            return min(low[1], high[1])
        return low[1] + (target - low[0]) / (high[0] - low[0]) * (high[1] - low[1])

    cost, low, high = min((between(lo, hi), lo[2], hi[2]) for lo in below for hi in above)
    return {"ratio": kv["replica_seconds"] / cost, "replica_seconds": cost, "between": [low, high], **span}


PLOTTED = ("kvscale", "kvscale-requests-only", "hpa-concurrency", "keda-queue", "kpa-kv")  # defaults


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 3.2 * len(names)), squeeze=False)
    for row, workload in enumerate(names):
        for policy, data in results[workload]["policies"].items():
            if policy not in PLOTTED:
                continue
            times = [p[0] for p in data["timeline"]]
            axes[row][0].step(times, [p[1] for p in data["timeline"]], where="post", label=policy)
            ttft = data["ttft_series"]
            axes[row][1].plot([p[0] for p in ttft], [p[1] for p in ttft], ".", ms=2, label=policy)
        load = results[workload]["load_series"]
        twin = axes[row][0].twinx()
        twin.plot([p[0] for p in load], [p[1] for p in load], color="grey", alpha=0.4, lw=1)
        twin.set_ylabel("arrivals / 10 s", color="grey")
        axes[row][0].set_title(f"{workload}: replicas wanted (grey: load)", fontsize=9)
        axes[row][0].set_xlabel("s (simulated)")
        axes[row][1].set_title(f"{workload}: TTFT by arrival", fontsize=9)
        axes[row][1].set_yscale("log")
        axes[row][0].legend(fontsize=7)
        axes[row][1].legend(fontsize=7, markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="measure a real replica first")
    parser.add_argument("--calibration", default=str(CALIBRATION))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--router", default=DEFAULT_POLICY,
                        help=f"the fleet's router for every policy: a kvscale routing policy, or "
                             f"{FEWEST_OPEN} (the replica with the fewest open requests, the stand-in "
                             "for a router in older runs)")
    parser.add_argument("--step-tokens", type=int, default=None,
                        help="what-if: the replicas' --max-num-batched-tokens instead of the "
                             "calibration's 512 (the chunked-prefill budget)")
    parser.add_argument("--level", choices=("a", "b"), default="b",
                        help="a: real replicas on the whole-platform runtime (bench.autoscale_platform)")
    parser.add_argument("--policies", default="kvscale,hpa-real",
                        help="level a: kvscale and/or hpa-real (the real HPA via prometheus-adapter)")
    parser.add_argument("--span", type=float, default=240.0,
                        help="level a: seconds of compressed bursty trace per policy")
    parser.add_argument("--step-load", type=float, default=0.3,
                        help="level a: the x4 step's rate as a fraction of one calibrated replica's "
                             "capacity (the base is a quarter of it); 0.3: what this 2-core host "
                             "served with queueing, not timeouts (docs/performance.md, "
                             "\"Autoscaling\")")
    parser.add_argument("--dashboard", default=None,
                        help="level a: render the autoscaling dashboard of the kvscale policy's run "
                             "from its Prometheus into this PNG")
    parser.add_argument("--compare-only", default=None, metavar="LEVEL_A_JSON",
                        help="level a: skip the real replay, set (b) against this earlier result")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # level (a)'s control plane, pods and Prometheus stop on SIGTERM too
    if args.calibrate:
        if Path(args.calibration).resolve() == CALIBRATION.resolve() and CALIBRATION.exists():
            raise SystemExit(f"{CALIBRATION} is the measurement docs/performance.md's level-(b) figures "
                             "quote: write a new one elsewhere (--calibration NEW.json)")
        measured = calibrate()
        write_result("autoscale_calibration", {"benchmark": "autoscale_calibration",
                                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "machine": {**machine(), "cpu": cpu_isa()},
                                               "calibration": measured},
                     args.calibration)
        print(json.dumps(measured, indent=2))
        if not args.workloads and args.level == "b":
            return 0
    if args.level == "a":
        return level_a(args)
    calibration = load_calibration(Path(args.calibration))
    if args.step_tokens:
        calibration = replace(calibration, step_tokens=args.step_tokens)
    started = time.monotonic()
    results: dict = {}
    for workload in filter(None, args.workloads.split(",")):
        description, build = WORKLOADS[workload]
        requests = build(calibration)
        span = requests[-1].arrival
        ttft_slo, tpot_slo = slo(requests, calibration)
        entry = {"scaling": description, "requests": len(requests), "span_s": span,
                 "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo,
                 "attainable_ttft_share": attainable_ttft_share(requests, calibration, ttft_slo), "policies": {},
                 "load_series": [(b * 10, n) for b, n in sorted(_bins(requests).items())]}
        for policy in policies(workload, calibration):
            begin = time.monotonic()
            outcome = simulate(requests, policy, calibration, start_replicas=1,
                               hold_timeout_s=120.0, router=args.router)
            figures = report(outcome, ttft_slo, tpot_slo, span)
            figures["sim_wall_s"] = round(time.monotonic() - begin, 1)
            if workload == "bursty":  # the x4 step at 60 s: how soon the first scale-up came
                ups = [t for t, frm, to in outcome.decisions if to > frm and t >= 60.0]
                figures["step_x4_to_scale_up_s"] = (ups[0] - 60.0) if ups else None
            figures["timeline"] = [(round(t, 1), wanted, ready) for t, wanted, ready, _ in outcome.timeline]
            figures["ttft_series"] = [(round(r.arrival, 1), round(r.first_token - r.arrival, 3))
                                      for r in outcome.requests if r.first_token is not None
                                      ][::max(1, len(outcome.requests) // 1000)]
            entry["policies"][policy.name] = figures
            print(f"{workload:9s} {policy.name:16s} SLO {figures['slo_attainment']:.3f} "
                  f"replica-s {figures['replica_seconds']:.0f} failed {figures['failed']} "
                  f"reversals/h {figures['reversals_per_hour']:.1f} "
                  f"missed ttft/tpot/both {figures['missed_ttft_only']}/{figures['missed_tpot_only']}/"
                  f"{figures['missed_both']} "
                  f"on-removed {figures['requests_on_removed_pods']} ({figures['sim_wall_s']} s)",
                  flush=True)
        base = entry["policies"]
        kv = base["kvscale"]
        entry["ratios"] = {
            "replica_seconds_vs_hpa": kv["replica_seconds"] / base["hpa-concurrency"]["replica_seconds"],
            "replica_seconds_vs_keda": kv["replica_seconds"] / base["keda-queue"]["replica_seconds"],
            "replica_seconds_vs_hpa_at_equal_attainment": at_equal_attainment(base, "hpa-concurrency"),
            "replica_seconds_vs_keda_at_equal_attainment": at_equal_attainment(base, "keda-queue"),
            "reversals_vs_kpa": (kv["reversals_per_hour"] / base["kpa-kv"]["reversals_per_hour"]
                                 if base["kpa-kv"]["reversals_per_hour"] else None),
        }
        # Each of kvscale's settings against the baselines' at its own attainment.
        entry["settings_at_equal_attainment"] = {
            name: {"slo_attainment": f["slo_attainment"], "replica_seconds": f["replica_seconds"],
                   "vs_hpa": at_equal_attainment(base, "hpa-concurrency", name),
                   "vs_keda": at_equal_attainment(base, "keda-queue", name)}
            for name, f in base.items() if name.startswith("kvscale")}
        print(f"{workload:9s} attainable TTFT share (every policy's ceiling): {entry['attainable_ttft_share']:.3f}")
        for name, row in entry["settings_at_equal_attainment"].items():
            print(f"{workload:9s} {name:24s} SLO {row['slo_attainment']:.3f} replica-s {row['replica_seconds']:.0f} "
                  f"vs HPA {_ratio_text(row['vs_hpa'])} vs KEDA {_ratio_text(row['vs_keda'])}")
        results[workload] = entry
    out = {"benchmark": "autoscale_replay", "level": "b (simulated fleet, calibrated)",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "calibration": asdict(calibration), "router": args.router, "results": results,
           "elapsed_s": round(time.monotonic() - started, 1)}
    plot(results, (Path(args.out) if args.out else RESULTS / "autoscale_replay.json").with_suffix(".png"))
    # The series behind the plot, compact, apart from the figures.
    series = {w: {"load": e.pop("load_series"),
                  "policies": {p: {"timeline": f.pop("timeline"), "ttft": f.pop("ttft_series")}
                               for p, f in e["policies"].items()}}
              for w, e in results.items()}
    path = write_result("autoscale_replay", out, args.out)
    path.with_name(path.stem + "_series.json").write_text(json.dumps(series, separators=(",", ":")))
    print(f"wrote {path}, its _series.json and {path.with_suffix('.png')}")
    return 0


def _ratio_text(comparison: dict) -> str:
    return f"{comparison['ratio']:.2f}x" if comparison["ratio"] is not None else f"- ({comparison['reason']})"


def _bins(requests: list[SimRequest]) -> dict[int, int]:
    bins: dict[int, int] = {}
    for r in requests:
        bins[int(r.arrival // 10)] = bins.get(int(r.arrival // 10), 0) + 1
    return bins


if __name__ == "__main__":
    raise SystemExit(main())
