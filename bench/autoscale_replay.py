"""Autoscaling policies replayed on the same arrivals (issue 23), level (b): the simulated fleet of
`bench.autoscale_sim`, calibrated from one real replica of the bundled model.

    flock /tmp/kvscale-bench.lock python -m bench.autoscale_replay --calibrate   # real replica
    python -m bench.autoscale_replay            # bench/results/autoscale_replay.json + .png

`--calibrate` starts a real `kvscale serve` (the platform tests' engine flags) and measures, on
this machine: the cold start (process start to /health 200, the model load and warm-up), the KV
pool (`kvscale:kv_blocks_total`), the prefill rate (a 480-token prompt's time to first token) and
a decode step (a 64-token answer's time after its first token), each the median of 3 runs. It
writes bench/results/autoscale_calibration.json; the replay reads it.

Workloads (the scaling is written next to every figure in the JSON and docs/benchmarks.md):

- `mooncake`: the Mooncake conversation trace (../shared/data/traces/), the whole hour in real
  time (a simulation needs no compression), each 512-token hash block mapped to one 16-token KV
  block (tokens / 32, the prefix sharing kept), outputs / 16 (at least 1 token).
- `bursty`: synthetic, 900 s: a base rate of 0.6 x one calibrated replica's capacity, steps x4
  up at 60 s and down at 240 s, again up at 420 s and down at 480 s, then a diurnal ramp
  (1 + 3 sin^2) to the end; 8 shared 128-token prefixes, 256-token prompts, 32-token answers.
- `idle`: 1800 s, a burst of 6 requests every 300 s and nothing between (kvscale with
  minReplicas 0, scaleToZeroAfterSeconds 60; the others cannot go below one replica).

Policies (bench.autoscale_sim): kvscale (the operator's rule, imported), hpa-concurrency,
keda-queue, kpa-kv, all behind the same router (kvscale's own decision functions by default,
`--router`). SLO: TTFT within max(1 s, 4 x the median prompt's prefill time on one idle
replica) and TPOT within 3 x one decode step. The real HPA of kube-controller-manager through
prometheus-adapter is a policy of level (a) only: `--level a` (bench.autoscale_platform) replays
a compressed bursty trace on real replicas on the whole-platform runtime, policies `kvscale` and
`hpa-real`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.autoscale_sim import (
    FEWEST_OPEN,
    Calibration,
    HpaPolicy,
    KpaPolicy,
    KvscalePolicy,
    report,
    simulate,
)
from bench.common import MOONCAKE_TRACE, REPO, RESULTS, machine, shared_data, write_result
from bench.w3_policy_sim import SimRequest
from kvscale.operator.spec import AutoscalingPolicy
from kvscale.router.policy import DEFAULT_POLICY

CALIBRATION = RESULTS / "autoscale_calibration.json"
BLOCK = 16
MAX_REPLICAS = 16
ENGINE_FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                "--block-size", str(BLOCK)]


# -- calibration on a real replica --------------------------------------------------------------

def calibrate() -> dict:
    import httpx

    from kvscale.processes import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *ENGINE_FLAGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit("kvscale serve exited during calibration")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        cold_start = time.monotonic() - started
        metrics = httpx.get(url + "/metrics", timeout=5).text
        kv_blocks = int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                            if line.startswith("kvscale:kv_blocks_total")))
        client = httpx.Client(base_url=url, timeout=120)
        prompt_ids = [random.Random(i).randrange(1000, 20000) for i in range(480)]

        def timed(prompt: list[int], max_tokens: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/completions", json={
                    "model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens,
                    "min_tokens": max_tokens, "temperature": 0, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and first is None:
                        first = time.perf_counter() - t0
            return first or 0.0, time.perf_counter() - t0

        timed(prompt_ids[:16], 2)  # anything left to warm
        prefill, decode = [], []
        for run in range(3):
            fresh = [(t + 7919 * (run + 1)) % 30000 + 100 for t in prompt_ids]  # no cache hit
            ttft, _ = timed(fresh, 1)
            prefill.append(len(fresh) / ttft)
            ttft, total = timed([5 + run, 6, 7, 8], 64)
            decode.append((total - ttft) / 63)
        return {"cold_start_s": cold_start, "kv_blocks": kv_blocks,
                "prefill_tokens_per_s": statistics.median(prefill),
                "decode_step_s": statistics.median(decode), "runs": {"prefill": prefill, "decode": decode},
                "engine_flags": ENGINE_FLAGS}
    finally:
        proc.terminate()
        proc.wait(30)


def load_calibration(path: Path) -> Calibration:
    data = json.loads(path.read_text())["calibration"]
    return Calibration(prefill_tokens_per_s=data["prefill_tokens_per_s"],
                       decode_step_s=data["decode_step_s"], kv_blocks=data["kv_blocks"],
                       block_size=BLOCK, max_num_seqs=16, step_tokens=512,
                       cold_start_s=data["cold_start_s"])


# -- workloads ----------------------------------------------------------------------------------

def mooncake(compress: float = 1.0, token_div: int = 32, out_div: int = 16) -> list[SimRequest]:
    path = shared_data(*MOONCAKE_TRACE)
    requests = []
    for rid, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        hashes = [int(h) for h in row["hash_ids"]]
        prompt = max(1, min(len(hashes) * BLOCK, math.ceil(row["input_length"] / token_div)))
        output = max(1, round(row["output_length"] / out_div))
        answer = [-(rid * 1000 + i) - 1 for i in range(math.ceil(output / BLOCK))]
        requests.append(SimRequest(rid, row["timestamp"] / 1000.0 / compress, hashes[: math.ceil(prompt / BLOCK)],
                                   prompt, output, answer_hashes=answer))
    return requests


def synthetic(rate_at, span_s: float, seed: int, prompt: int = 256, output: int = 32) -> list[SimRequest]:
    rng = random.Random(seed)
    requests, t, rid = [], 0.0, 0
    peak = max(rate_at(x) for x in range(int(span_s)))
    while t < span_s:  # thinning: a Poisson process of the time-varying rate
        t += rng.expovariate(peak)
        if t < span_s and rng.random() < rate_at(t) / peak:
            group = rng.randrange(8)
            shared = [10_000_000 + group * 100 + i for i in range(128 // BLOCK)]
            own = [20_000_000 + rid * 100 + i for i in range((prompt - 128) // BLOCK)]
            requests.append(SimRequest(rid, t, shared + own, prompt, output,
                                       answer_hashes=[-(rid * 1000 + i) - 1 for i in range(output // BLOCK)]))
            rid += 1
    return requests


def bursty_rate(base: float):
    """Steps x4 up and down, then a diurnal ramp up to x4 and back."""
    def rate(t: float) -> float:
        if 60 <= t < 240 or 420 <= t < 480:
            return 4 * base
        if t >= 600:
            return base * (1 + 3 * math.sin(math.pi * (t - 600) / 300) ** 2)
        return base
    return rate


def one_replica_rps(calibration: Calibration, prompt: int, output: int) -> float:
    """Requests per second one replica serves at a full batch: its prefill time plus its share
    of the batch's decode steps."""
    per_request = prompt / calibration.prefill_tokens_per_s + output * calibration.decode_step_s / 8
    return 1.0 / per_request


def idle_heavy(seed: int = 3) -> list[SimRequest]:
    rng = random.Random(seed)
    requests: list[SimRequest] = []
    for burst in range(6):
        for _ in range(6):
            rid = len(requests)
            t = burst * 300 + 5 + rng.uniform(0, 10)
            requests.append(SimRequest(rid, t, [30_000_000 + rid * 100 + i for i in range(8)], 128, 32,
                                       answer_hashes=[-(rid * 1000) - 1, -(rid * 1000) - 2]))
    return sorted(requests, key=lambda r: r.arrival)


WORKLOADS = {
    "mooncake": ("Mooncake conversation trace, the whole hour in real time, tokens /32 (a 512-token "
                 "block -> one 16-token block), outputs /16",
                 lambda calibration: mooncake()),
    "bursty": ("synthetic 900 s: base rate 0.6 x one replica's capacity (256-token prompts, 32-token "
               "answers), x4 steps up/down at 60/240 s and 420/480 s, diurnal ramp to x4 from 600 s",
               lambda calibration: sorted(synthetic(bursty_rate(0.6 * one_replica_rps(calibration, 256, 32)),
                                                    900.0, seed=1), key=lambda r: r.arrival)),
    "idle": ("synthetic 1800 s: 6 requests every 300 s, idle between", lambda calibration: idle_heavy()),
}


def policies(workload: str, calibration: Calibration):
    to_zero = workload == "idle"
    kvscale = AutoscalingPolicy(enabled=True, min_replicas=0 if to_zero else 1,
                                max_replicas=MAX_REPLICAS, scale_to_zero_after_seconds=60)
    concurrency_target = calibration.max_num_seqs / 2
    # The rule without its prefill term (the queue in requests only: the rule before 2026-11-26),
    # and its sensitivity to targetPrefillSeconds (1 s is the CRD's default), same everything else.
    before = KvscalePolicy(replace(kvscale, target_prefill_seconds=math.inf))
    before.name = "kvscale-requests-only"
    variants = [before]
    for seconds in (0.5, 2.0, 4.0):
        variant = KvscalePolicy(replace(kvscale, target_prefill_seconds=seconds))
        variant.name = f"kvscale-prefill{seconds:g}s"
        variants.append(variant)
    return [
        KvscalePolicy(kvscale),
        *variants,
        HpaPolicy("hpa-concurrency", "concurrency", concurrency_target, 1, MAX_REPLICAS),
        HpaPolicy("keda-queue", "waiting", 5.0, 1, MAX_REPLICAS),
        KpaPolicy(0.7, 1, MAX_REPLICAS),
    ]


def slo(requests: list[SimRequest], calibration: Calibration) -> tuple[float, float]:
    prompt_p50 = statistics.median(r.prompt_tokens for r in requests)
    return (max(1.0, 4 * prompt_p50 / calibration.prefill_tokens_per_s), 3 * calibration.decode_step_s)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 3.2 * len(names)), squeeze=False)
    for row, workload in enumerate(names):
        for policy, data in results[workload]["policies"].items():
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
                             "before 2026-11-26)")
    parser.add_argument("--step-tokens", type=int, default=None,
                        help="what-if: the replicas' --max-num-batched-tokens instead of the "
                             "calibration's 512 (the chunked-prefill budget)")
    parser.add_argument("--level", choices=("a", "b"), default="b",
                        help="a: real replicas on the whole-platform runtime (bench.autoscale_platform)")
    parser.add_argument("--policies", default="kvscale,hpa-real",
                        help="level a: kvscale and/or hpa-real (the real HPA via prometheus-adapter)")
    parser.add_argument("--span", type=float, default=240.0,
                        help="level a: seconds of compressed bursty trace per policy")
    args = parser.parse_args(argv)
    if args.level == "a":
        return level_a(args)
    if args.calibrate:
        measured = calibrate()
        write_result("autoscale_calibration", {"benchmark": "autoscale_calibration",
                                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "machine": machine(), "calibration": measured},
                     args.calibration)
        print(json.dumps(measured, indent=2))
    calibration = load_calibration(Path(args.calibration))
    if args.step_tokens:
        calibration = replace(calibration, step_tokens=args.step_tokens)
    started = time.monotonic()
    results: dict = {}
    for workload in args.workloads.split(","):
        description, build = WORKLOADS[workload]
        requests = build(calibration)
        span = requests[-1].arrival
        ttft_slo, tpot_slo = slo(requests, calibration)
        entry = {"scaling": description, "requests": len(requests), "span_s": span,
                 "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "policies": {},
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
            "reversals_vs_kpa": (kv["reversals_per_hour"] / base["kpa-kv"]["reversals_per_hour"]
                                 if base["kpa-kv"]["reversals_per_hour"] else None),
        }
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


def compressed_bursty(calibration: Calibration, span: float, seed: int = 1) -> list[SimRequest]:
    """Level (a)'s arrivals: the bursty workload squeezed into ``span`` seconds: the base rate
    (0.6 x one replica's capacity), x4 from 25 % to 75 % of the span, the base again."""
    base = 0.6 * one_replica_rps(calibration, 256, 32)

    def rate(t: float) -> float:
        return 4 * base if 0.25 * span <= t < 0.75 * span else base

    return sorted(synthetic(rate, span, seed=seed), key=lambda r: r.arrival)


def level_a(args: argparse.Namespace) -> int:
    import tempfile

    from bench.autoscale_platform import run_level_a, write

    calibration = load_calibration(Path(args.calibration))
    requests = compressed_bursty(calibration, args.span)
    ttft_slo, tpot_slo = slo(requests, calibration)
    with tempfile.TemporaryDirectory(prefix="kvscale-level-a-") as tmp:
        out = run_level_a(args.policies.split(","), requests, calibration, ttft_slo, tpot_slo,
                          Path(tmp))
    out["scaling"] = (f"synthetic bursty compressed to {args.span:.0f} s: base rate 0.6 x one "
                      "calibrated replica's capacity (256-token prompts over 8 shared 128-token "
                      "prefixes, 32-token answers), x4 from 25 % to 75 % of the span")
    out["requests"] = len(requests)
    path = write(out, args.out)
    print(f"wrote {path}")
    return 0


def _bins(requests: list[SimRequest]) -> dict[int, int]:
    bins: dict[int, int] = {}
    for r in requests:
        bins[int(r.arrival // 10)] = bins.get(int(r.arrival // 10), 0) + 1
    return bins


if __name__ == "__main__":
    raise SystemExit(main())
