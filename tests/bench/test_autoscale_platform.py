"""Level (a) of the autoscaling replay (bench/autoscale_platform.py): the arrivals and the figures
it derives from a run, on inputs whose answer is known (the replay itself needs the platform)."""

from __future__ import annotations

from bench.autoscale_client import Outcome, prompt_text
from bench.autoscale_platform import Run, figures
from bench.autoscale_sim import Calibration
from bench.autoscale_workloads import compressed_bursty

CAL = Calibration(prefill_tokens_per_s=270.0, decode_step_s=0.047, kv_blocks=2912, block_size=16,
                  max_num_seqs=16, step_tokens=512, cold_start_s=15.0)


def test_the_compressed_trace_steps_x4_in_its_middle_half() -> None:
    requests = compressed_bursty(CAL, 400.0)
    outer = sum(1 for r in requests if r.arrival < 100 or r.arrival >= 300)
    middle = len(requests) - outer
    assert 3.0 < middle / outer < 5.0, (middle, outer)  # same length, four times the rate
    assert requests == sorted(requests, key=lambda r: r.arrival)
    # Requests of one prefix group share their first 128 words, the rest is their own.
    same = [r for r in requests if r.hashes[0] == requests[0].hashes[0]][:2]
    a, b = (prompt_text(r) for r in same)
    assert a.split("\n")[0] == b.split("\n")[0] and a != b


def test_the_trace_probe_has_the_traces_arrivals_but_shares_nothing_with_it() -> None:
    from bench.autoscale_workloads import PROBE_TRACE_SPAN_S, prefix_group, probe_trace

    trace = compressed_bursty(CAL, 400.0, base_fraction=0.25)
    probe = probe_trace(CAL, base_fraction=0.25)
    assert probe == sorted(probe, key=lambda r: r.arrival) and probe[-1].arrival < PROBE_TRACE_SPAN_S
    # The same process: the trace's rate in each phase (base, then x4 in the middle half).
    def rate(rs: list, span: float, lo: float, hi: float) -> float:
        return sum(lo * span <= r.arrival < hi * span for r in rs) / ((hi - lo) * span)

    for lo, hi in ((0.25, 0.75), (0.0, 0.25)):
        assert 0.4 < rate(probe, PROBE_TRACE_SPAN_S, lo, hi) / rate(trace, 400.0, lo, hi) < 2.5
    # No prefix block, request id or prompt text in common: the trace's cache starts as it would.
    assert not {h for r in probe for h in r.hashes} & {h for r in trace for h in r.hashes}
    assert not {r.rid for r in probe} & {r.rid for r in trace}
    assert {prefix_group(r) for r in probe} <= set(range(60, 68))
    assert not {prompt_text(r) for r in probe} & {prompt_text(r) for r in trace}


def test_figures_count_replica_seconds_in_the_span_and_reversals() -> None:
    run = Run("p", [Outcome(0.0, ttft=0.5, tpot=0.05), Outcome(1.0, ttft=5.0, tpot=0.05),
                    Outcome(2.0, error="HTTP 503")])
    # spec.replicas 1 -> 2 -> 3 -> 2 -> 3: up, up, down, up = 2 reversals; pods lag a step.
    run.timeline = [(0.0, 1, 1, 1), (10.0, 2, 1, 1), (20.0, 3, 2, 1), (30.0, 2, 3, 2),
                    (40.0, 3, 2, 2), (50.0, 3, 3, 3)]
    out = figures(run, span_s=45.0, ttft_slo=1.0, tpot_slo=0.1)
    assert out["replica_seconds"] == 10 * 1 + 10 * 1 + 10 * 2 + 10 * 3 + 5 * 2
    assert out["reversals"] == 2 and out["max_replicas"] == 3 and out["first_scale_up_s"] == 10.0
    assert out["failed"] == 1 and out["errors"] == ["HTTP 503"]
    assert out["slo_attainment"] == 1 / 3


def test_level_b_replays_level_as_policies_with_their_settings() -> None:
    from bench.autoscale_level_b import level_b_policy
    from bench.autoscale_policies import HpaPolicy, KvscalePolicy

    kvscale = level_b_policy("kvscale")
    assert isinstance(kvscale, KvscalePolicy)
    assert (kvscale.policy.min_replicas, kvscale.policy.max_replicas) == (1, 3)
    assert kvscale.policy.scale_down_stabilization_seconds == 300  # the CRD's default, as (a) runs
    hpa = level_b_policy("hpa-real")
    assert isinstance(hpa, HpaPolicy)
    assert (hpa.period_s, hpa.tolerance, hpa.down_window_s, hpa.target, hpa.max_replicas) == \
        (15.0, 0.1, 300.0, 8, 3)


def test_a_is_set_against_b_on_the_same_arrivals(tmp_path) -> None:
    import json

    from bench.autoscale_level_b import comparison_table, replay_level_b, within
    from bench.autoscale_workloads import slo

    assert within(10.0, 11.4) == (11.4 / 10.0, True) and within(10.0, 8.4)[1] is False
    assert within(None, 1.0) == (None, False)
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"calibration": {"shared_host": {
        "cores": 2.0, "busy_cores": 2.0, "start_cores": 1.0, "exponent": 1.2}}}))
    requests = compressed_bursty(CAL, 80.0, base_fraction=0.25)
    span = requests[-1].arrival
    from bench.autoscale_client import probe_requests

    # What (a) measured on the platform before the kvscale trace (the hpa-real side has none, as
    # results from before the probe): steps alone, the step at a batch, the TTFT probe.
    probe = {"decode_gaps_s": [CAL.decode_step_s * 1.2] * 50,
             "decode_at_batch": {"batch": 4.0, "tpot_s": CAL.decode_step_s * 1.5},
             "ttft": [(r.arrival, 0.3) for r in probe_requests()[1]]}
    level_a = {"span_s": span, "policies": {
        "kvscale": {"ttft_p90_s": 2.0, "replica_seconds": span, "background_cores": 0.4, "probe": probe},
        "hpa-real": {"ttft_p90_s": None, "replica_seconds": span}}}
    out = replay_level_b(level_a, requests, CAL, calibration, *slo(requests, CAL))
    kvscale = out["kvscale"]
    assert kvscale["host"]["step_factors"] == 50 and len(kvscale["path_residuals_s"]) == len(probe["ttft"])
    assert kvscale["path_residuals_from"] == "spaced probe" and "shared_host_spaced_probe" not in kvscale
    assert abs(kvscale["decode_step_per_seq_s"] - CAL.decode_step_s * (1.5 / 1.2 - 1) / 3) < 1e-12
    assert out["hpa-real"]["host"]["step_factors"] == 0 and out["hpa-real"]["path_residuals_s"] == []
    assert out["hpa-real"]["decode_step_per_seq_s"] == CAL.decode_step_per_seq_s
    assert kvscale["shared_host"]["replica_seconds"] <= 3 * span + 0.1
    assert out["kvscale"]["validation"]["replica_seconds_b_over_a"] == \
        kvscale["shared_host"]["replica_seconds"] / span
    assert out["hpa-real"]["validation"]["ttft_p90_within"] is False  # (a) had no TTFT
    # The background CPU (a) measured reaches the simulated host; the shared host is no faster.
    assert kvscale["host"]["background_cores"] == 0.4 and out["hpa-real"]["host"]["background_cores"] == 0.0
    assert kvscale["shared_host"]["ttft_p90_s"] >= kvscale["independent"]["ttft_p90_s"]
    assert kvscale["shared_host"]["failed"] == 0
    table = comparison_table(level_a, out)
    assert table.count("\n") == 3 and "| kvscale | 2.00 s |" in table


def test_the_replays_prometheus_scrapes_what_the_autoscaling_dashboard_needs(tmp_path) -> None:
    import subprocess

    import yaml
    from custom_metrics import prometheus_config

    config = prometheus_config(tmp_path / "servers.json", platform=True)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvscale-servers", "kvscale-routers", "kvscale-operator"}
    # The operator's series carry namespace and inferenceservice themselves (the chart's honorLabels).
    assert jobs["kvscale-operator"]["honor_labels"] is True
    assert not jobs["kvscale-routers"]["honor_labels"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert [j["job_name"] for j in prometheus_config(tmp_path / "s.json")["scrape_configs"]] == \
        ["kvscale-servers"]


def test_level_b_takes_the_trace_probes_residuals_where_a_measured_them(tmp_path) -> None:
    import json

    from bench.autoscale_calibrate import load_shared_host
    from bench.autoscale_client import probe_requests
    from bench.autoscale_level_b import path_residuals, replay_level_b
    from bench.autoscale_workloads import probe_trace, slo

    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"calibration": {"shared_host": {
        "cores": 2.0, "busy_cores": 1.0, "start_cores": 1.0, "exponent": 1.0}}}))
    requests = compressed_bursty(CAL, 80.0, base_fraction=0.25)
    span = requests[-1].arrival
    trace_probe = probe_trace(CAL, base_fraction=0.25)
    host = load_shared_host(calibration)
    # A platform that adds exactly 0.4 s to every first token the simulator gives.
    simulated = path_residuals([(r.arrival, 0.0) for r in trace_probe], trace_probe, [], CAL, host)
    measured = [(r.arrival, round(0.4 - lag, 4)) for r, lag in zip(trace_probe, simulated, strict=True)]
    spaced = [(r.arrival, 0.2) for r in probe_requests()[1]]
    level_a = {"span_s": span, "policies": {"kvscale": {
        "ttft_p90_s": 2.0, "replica_seconds": span, "probe": {"ttft": spaced, "trace": measured}}}}
    out = replay_level_b(level_a, requests, CAL, calibration, *slo(requests, CAL), trace_probe=trace_probe)
    kvscale = out["kvscale"]
    assert kvscale["path_residuals_from"] == "trace probe"
    assert all(abs(r - 0.4) < 1e-3 for r in kvscale["path_residuals_s"])
    # The trace probe's 0.4 s is added to the simulated first tokens, not the spaced probe's
    # (about 0.2 s), whose replay is kept beside it for comparison.
    assert kvscale["shared_host"]["ttft_p50_s"] > kvscale["shared_host_spaced_probe"]["ttft_p50_s"]
    assert kvscale["ttft_p90_b_over_a_spaced_probe"] == kvscale["shared_host_spaced_probe"]["ttft_p90_s"] / 2.0
    # Without the trace probe's requests (an older result), the spaced probe's residuals stand.
    older = replay_level_b(level_a, requests, CAL, calibration, *slo(requests, CAL))
    assert older["kvscale"]["path_residuals_from"] == "spaced probe"


def test_the_per_sequence_cost_is_fitted_to_the_trace_probes_tpot(tmp_path) -> None:
    import json
    from dataclasses import replace

    from bench.autoscale_calibrate import load_shared_host
    from bench.autoscale_level_b import fitted_per_sequence_cost, on_one_replica
    from bench.autoscale_sim import tpot
    from bench.autoscale_workloads import probe_trace

    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"calibration": {"shared_host": {
        "cores": 2.0, "busy_cores": 1.0, "start_cores": 1.0, "exponent": 1.0}}}))
    host = load_shared_host(calibration)
    probe = probe_trace(CAL, base_fraction=0.3)
    # A platform on which each decoding stream costs a step 12 ms: the probe as it measured it.
    served = {r.rid: r for r in on_one_replica(probe, replace(CAL, decode_step_per_seq_s=0.012), host)}
    measured = [(r.arrival, 0.5, tpot(served[r.rid])) for r in probe]
    fitted = fitted_per_sequence_cost(measured, probe, CAL, host)
    assert fitted is not None and abs(fitted - 0.012) < 0.003, fitted
    # The simulator with the fitted cost gives the probe its measured median TPOT.
    again = on_one_replica(probe, replace(CAL, decode_step_per_seq_s=fitted), host)
    median = sorted(t for t in map(tpot, again) if t is not None)
    target = sorted(m[2] for m in measured if m[2] is not None)
    assert abs(median[len(median) // 2] - target[len(target) // 2]) < 0.05 * target[len(target) // 2]
    # Results from before the probe recorded TPOTs: nothing to fit.
    assert fitted_per_sequence_cost([(r.arrival, 0.5) for r in probe], probe, CAL, host) is None
