"""Level (b) set against level (a) (`bench.autoscale_replay --level a`): level (a)'s arrivals
replayed in the simulator per policy of (a), on replicas sharing the host's cores as (a) measured
them (its probes' decode steps, first-token residuals and per-stream cost), and the table of
TTFT p90 and replica-seconds, (a) against (b), within the validation tolerance."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from bench.autoscale_calibrate import load_calibration, load_shared_host
from bench.autoscale_client import probe_requests
from bench.autoscale_platform import (
    HPA_TARGET_CONCURRENCY,
    MAX_REPLICAS,
    inference_service,
    run_level_a,
    write,
)
from bench.autoscale_policies import HpaPolicy, KvscalePolicy
from bench.autoscale_sim import Calibration, SharedHost, host_slowdown, report, simulate, tpot
from bench.autoscale_workloads import compressed_bursty, probe_trace, slo
from bench.roofline import cpu_isa
from bench.stats import quantile
from bench.w3_sim import SimRequest

VALIDATION_TOLERANCE = 0.15  # (a) validates (b) within +-15 % (docs/benchmarks.md, level (a))


def level_b_policy(name: str):
    """The simulator's policy standing for level (a)'s ``name``, with the same settings."""
    from kvscale.operator.spec import parse_spec

    if name == "kvscale":  # the very spec level (a) applies, parsed as the operator parses it
        return KvscalePolicy(parse_spec(inference_service("replay-kvscale", name)["spec"]).autoscaling)
    if name == "hpa-real":  # the real controller's settings: 15 s sync, 0.1, 300 s (HpaPolicy's)
        return HpaPolicy(name, "concurrency", HPA_TARGET_CONCURRENCY, 1, MAX_REPLICAS)
    raise ValueError(f"no level-(b) policy for {name!r}")


def within(a: float | None, b: float | None) -> tuple[float | None, bool]:
    """(b / a, whether b is within the tolerance of a)."""
    if not a or b is None or math.isnan(b):
        return None, False
    ratio = b / a
    return ratio, abs(ratio - 1.0) <= VALIDATION_TOLERANCE


def with_step_factors(host: SharedHost, calibration: Calibration, gaps: list[float]) -> SharedHost:
    """``host`` with level (a)'s probe steps (a batch of one, through the platform) as
    `SharedHost.step_factors`: each over the step the simulator expects there, so that the
    simulated steps vary as the measured ones did, around the measured mean."""
    expected = calibration.decode_step_s * host_slowdown(host, 1, 0)
    return replace(host, step_factors=tuple(gap / expected for gap in gaps))


def path_residuals(measured: list, requests: list[SimRequest], background: list[SimRequest],
                   calibration: Calibration, host: SharedHost) -> list[float]:
    """What the platform added to each of level (a)'s probe requests' TTFT that the simulator's
    engine does not model: ``measured`` ((arrival, TTFT, ...) of ``requests``, in order) less the
    simulator's TTFT for the same requests on one replica, beside the same ``background``
    streams, on the same host."""
    if not measured or len(measured) != len(requests):
        return []
    simulated = {r.rid: r.first_token - r.arrival for r in on_one_replica(requests + background, calibration, host)
                 if r.first_token is not None}
    return [round(m[1] - simulated[r.rid], 4) for r, m in zip(requests, measured, strict=True)
            if m[1] is not None and r.rid in simulated]


def on_one_replica(requests: list[SimRequest], calibration: Calibration, host: SharedHost) -> list[SimRequest]:
    """``requests`` served by one simulated replica on ``host``, never scaled."""
    alone = HpaPolicy("probe", "concurrency", 1e9, 1, 1)
    return simulate(sorted(requests, key=lambda r: r.arrival), alone, calibration, start_replicas=1,
                    hold_timeout_s=300.0, host=host).requests


def fitted_per_sequence_cost(measured: list, requests: list[SimRequest], calibration: Calibration,
                             host: SharedHost) -> float | None:
    """The `Calibration.decode_step_per_seq_s` at which the simulator gives level (a)'s trace
    probe (``measured``: (arrival, TTFT, TPOT) of ``requests``) its measured median TPOT, on one
    replica on ``host``: what each decoding stream costs a step on the platform under the trace's
    load (the front end's and router's work per streamed token shares the engine's cores).
    Bisection: a step's cost grows with it. None without TPOTs (results from before the probe)."""
    tpots = [m[2] for m in measured if len(m) > 2 and m[2] is not None]
    if len(tpots) < 5 or len(measured) != len(requests):
        return None
    target = statistics.median(tpots)

    def simulated(per_sequence: float) -> float:
        served = on_one_replica(requests, replace(calibration, decode_step_per_seq_s=per_sequence), host)
        return statistics.median(t for t in map(tpot, served) if t is not None)

    low, high = 0.0, calibration.decode_step_s
    if simulated(low) >= target:
        return 0.0
    while simulated(high) < target:
        if high > 100 * calibration.decode_step_s:
            return high
        low, high = high, 2 * high
    for _ in range(16):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < target else (low, middle)
    return round((low + high) / 2, 6)


def add_path_latency(requests: list[SimRequest], residuals: list[float], seed: int = 1) -> None:
    """Each served request's first token (and its end) later by a residual drawn from
    `path_residuals` (seeded): the hops the simulator's engine does not model."""
    if not residuals:
        return
    rng = random.Random(seed)
    for r in requests:
        if r.first_token is not None:
            extra = max(rng.choice(residuals), r.arrival - r.first_token)  # never before it was sent
            r.first_token += extra
            if r.finished is not None:
                r.finished += extra


def with_platform_batch_cost(calibration: Calibration, probe: dict) -> Calibration:
    """``calibration`` with what each decoding sequence beyond the first adds to a step as level
    (a)'s platform showed it (the router's and the front end's work per streamed token shares the
    engine's cores): from the probe's step alone (its decode gaps' mean) and at its TTFT probe's
    batch. Unchanged without a probe (results from before it)."""
    gaps, at_batch = probe.get("decode_gaps_s"), probe.get("decode_at_batch")
    if not gaps or not at_batch or at_batch["batch"] <= 1:
        return calibration
    alone = statistics.fmean(gaps)
    per_sequence = calibration.decode_step_s * max(0.0, at_batch["tpot_s"] / alone - 1) / (at_batch["batch"] - 1)
    return replace(calibration, decode_step_per_seq_s=per_sequence)


def replay_level_b(level_a: dict, requests: list[SimRequest], base_calibration: Calibration,
                   calibration_path: Path, ttft_slo: float, tpot_slo: float,
                   trace_probe: list[SimRequest] | None = None) -> dict:
    """Level (a)'s arrivals through the simulator, per policy of (a): replicas sharing the host's
    cores (the host's background CPU as (a) measured it before its trace), and, for reference,
    independent replicas; TTFT p90 and replica-seconds over the span set against (a)'s.
    ``trace_probe``: the requests of (a)'s trace probe (`probe_trace`); where (a) measured them,
    the shared host's first tokens take their residuals, and the spaced probe's are replayed
    beside them (`shared_host_spaced_probe`) for comparison; otherwise the spaced probe's."""
    span = level_a["span_s"]
    out: dict = {}
    for name, measured in level_a["policies"].items():
        probe = measured.get("probe") or {}
        spaced_calibration = with_platform_batch_cost(base_calibration, probe)
        host = with_step_factors(load_shared_host(calibration_path, measured.get("background_cores", 0.0)),
                                 spaced_calibration, probe.get("decode_gaps_s") or [])
        background, spaced = probe_requests()
        spaced_residuals = path_residuals(probe.get("ttft") or [], spaced, background, spaced_calibration, host)
        trace = probe.get("trace") or []
        per_sequence = fitted_per_sequence_cost(trace, trace_probe or [], spaced_calibration, host)
        calibration = (spaced_calibration if per_sequence is None
                       else replace(spaced_calibration, decode_step_per_seq_s=per_sequence))
        trace_residuals = path_residuals(trace, trace_probe or [], [], calibration, host)
        residuals = trace_residuals or spaced_residuals
        entry: dict = {"host": {**asdict(host), "step_factors": len(host.step_factors)},
                       "path_residuals_s": residuals,
                       "path_residuals_from": "trace probe" if trace_residuals else "spaced probe",
                       "decode_step_per_seq_s": calibration.decode_step_per_seq_s,
                       "decode_step_per_seq_s_from": ("trace probe's TPOT" if per_sequence is not None
                                                      else "spaced probe's batch")}
        # The shared host with what the platform measured; independent replicas as the
        # level-(b) replays run them (the calibration alone), for reference; the way (b) took
        # the platform's measures before the trace probe, for comparison.
        variants = [("shared_host", host, calibration, residuals), ("independent", None, base_calibration, [])]
        if trace_residuals and spaced_residuals:
            variants.append(("shared_host_spaced_probe", host, spaced_calibration, spaced_residuals))
        for variant, on, costs, drawn in variants:
            outcome = simulate(requests, level_b_policy(name), costs, start_replicas=1,
                               hold_timeout_s=300.0, host=on, count_until=span)
            add_path_latency(outcome.requests, drawn)
            figures = report(outcome, ttft_slo, tpot_slo, span)
            ups = [t for t, frm, to in outcome.decisions if to > frm]
            # Quantiles as level (a) computes them (interpolated), over the served requests.
            ttfts = [r.first_token - r.arrival for r in outcome.requests if r.first_token is not None]
            entry[variant] = {
                "slo_attainment": figures["slo_attainment"], "ttft_p50_s": quantile(ttfts, 0.5),
                "ttft_p90_s": quantile(ttfts, 0.9), "tpot_p50_s": figures["tpot_p50_s"],
                "replica_seconds": round(outcome.replica_seconds_window, 1),
                "failed": figures["failed"], "first_scale_up_s": ups[0] if ups else None,
                "max_replicas": max([1, *(to for _, _, to in outcome.decisions)]),
                "decisions": [(round(t, 1), frm, to) for t, frm, to in outcome.decisions],
                "per_request": [(round(r.arrival, 3),
                                 None if r.first_token is None else round(r.first_token - r.arrival, 4))
                                for r in sorted(outcome.requests, key=lambda r: r.arrival)]}
        if "shared_host_spaced_probe" in entry:
            entry["ttft_p90_b_over_a_spaced_probe"] = within(
                measured.get("ttft_p90_s"), entry["shared_host_spaced_probe"]["ttft_p90_s"])[0]
        b = entry["shared_host"]
        ttft_ratio, ttft_ok = within(measured.get("ttft_p90_s"), b["ttft_p90_s"])
        rs_ratio, rs_ok = within(measured.get("replica_seconds"), b["replica_seconds"])
        entry["validation"] = {"ttft_p90_b_over_a": ttft_ratio, "ttft_p90_within": ttft_ok,
                               "replica_seconds_b_over_a": rs_ratio, "replica_seconds_within": rs_ok,
                               "tolerance": VALIDATION_TOLERANCE,
                               # Not among the two validated figures, shown beside them.
                               "tpot_p50_b_over_a": within(measured.get("tpot_p50_s"), b["tpot_p50_s"])[0],
                               "slo_attainment_b_minus_a": (None if measured.get("slo_attainment") is None
                                                            else b["slo_attainment"] - measured["slo_attainment"])}
        out[name] = entry
    return out


def comparison_table(level_a: dict, level_b: dict) -> str:
    """(a) against (b) per policy, as printed and as docs/benchmarks.md shows it."""
    def f(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| policy | TTFT p90 (a) | TTFT p90 (b, shared host) | b/a | replica-s (a) | "
             "replica-s (b, shared host) | b/a | within +-15 % | (b) independent replicas: TTFT p90 / replica-s | "
             "TPOT p50 (a) / (b) | SLO attained (a) / (b) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, b in level_b.items():
        a, v, ind = level_a["policies"][name], b["validation"], b["independent"]
        ok = ("both" if v["ttft_p90_within"] and v["replica_seconds_within"] else
              "TTFT only" if v["ttft_p90_within"] else
              "replica-s only" if v["replica_seconds_within"] else "neither")
        lines.append(f"| {name} | {f(a.get('ttft_p90_s'), 2)} s | {f(b['shared_host']['ttft_p90_s'], 2)} s | "
                     f"{f(v['ttft_p90_b_over_a'], 2)} | {f(a.get('replica_seconds'))} | "
                     f"{f(b['shared_host']['replica_seconds'])} | {f(v['replica_seconds_b_over_a'], 2)} | "
                     f"{ok} | {f(ind['ttft_p90_s'], 2)} s / {f(ind['replica_seconds'])} | "
                     f"{f(a.get('tpot_p50_s'), 3)} / {f(b['shared_host']['tpot_p50_s'], 3)} s | "
                     f"{f(a.get('slo_attainment'), 3)} / {f(b['shared_host']['slo_attainment'], 3)} |")
    return "\n".join(lines)


def level_a(args: argparse.Namespace) -> int:
    import tempfile

    calibration_path = Path(args.calibration)
    calibration = load_calibration(calibration_path)
    base_fraction = args.step_load / 4
    requests = compressed_bursty(calibration, args.span, base_fraction=base_fraction)
    probe = probe_trace(calibration, base_fraction)
    ttft_slo, tpot_slo = slo(requests, calibration)
    if args.compare_only:  # (b) against a level-(a) result already measured
        out = json.loads(Path(args.compare_only).read_text())
        if out.get("requests") != len(requests):
            raise SystemExit(f"{args.compare_only} replayed {out.get('requests')} requests, these "
                             f"arguments make {len(requests)}: not the same arrivals")
    else:
        dashboard = Path(args.dashboard) if args.dashboard else None
        load_before = [round(x, 2) for x in os.getloadavg()]
        with tempfile.TemporaryDirectory(prefix="kvscale-level-a-") as tmp:
            out = run_level_a(args.policies.split(","), requests, calibration, ttft_slo, tpot_slo,
                              Path(tmp), dashboard=dashboard, probe_trace=probe)
        out["scaling"] = (f"synthetic bursty compressed to {args.span:.0f} s: base rate "
                          f"{base_fraction:g} x one calibrated replica's capacity (256-token prompts "
                          "over 8 shared 128-token prefixes, 32-token answers), x4 from 25 % to 75 % "
                          f"of the span (the step at {args.step_load:g} x one replica's capacity)")
        out["requests"] = len(requests)
        out["calibration_file"] = str(calibration_path)
        out["machine"]["cpu"] = cpu_isa()
        out["loadavg_before"] = load_before  # 1, 5, 15 min
        out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        print(f"wrote {write(out, args.out)} (level a; level b next)", flush=True)
    out["level_b_replay"] = replay_level_b(out, requests, calibration, calibration_path,
                                           ttft_slo, tpot_slo, trace_probe=probe)
    table = comparison_table(out, out["level_b_replay"])
    out["comparison_table"] = table
    print(table)
    path = write(out, args.out)
    print(f"wrote {path}")
    return 0
