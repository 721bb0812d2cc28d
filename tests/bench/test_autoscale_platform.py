"""Level (a) of the autoscaling replay (bench/autoscale_platform.py): the arrivals and the figures
it derives from a run, on inputs whose answer is known (the replay itself needs the platform)."""

from __future__ import annotations

from bench.autoscale_platform import Outcome, Run, figures, prompt_text
from bench.autoscale_replay import compressed_bursty
from bench.autoscale_sim import Calibration

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
