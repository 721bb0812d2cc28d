"""The arrivals the autoscaling replay sends: the Mooncake trace scaled to the bundled model,
the synthetic bursty and idle workloads, level (a)'s compressed bursty trace and its trace probe,
and the SLO every policy is held to. Both levels read them: level (a) on real replicas
(bench.autoscale_platform), level (b) in the simulator (bench.autoscale_replay)."""

from __future__ import annotations

import json
import math
import random
import statistics

from bench.autoscale_sim import Calibration
from bench.common import MOONCAKE_TRACE, shared_data
from bench.w3_sim import SimRequest

BLOCK = 16


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


def shaped_request(rid: int, group: int, arrival: float, prompt: int = 256, output: int = 32) -> SimRequest:
    """A request of the synthetic workloads' shape: a 128-token prefix shared by its ``group``,
    then blocks of its own (`bench.autoscale_client.prompt_text` writes its text)."""
    shared = [10_000_000 + group * 100 + i for i in range(128 // BLOCK)]
    own = [20_000_000 + rid * 100 + i for i in range((prompt - 128) // BLOCK)]
    return SimRequest(rid, arrival, shared + own, prompt, output,
                      answer_hashes=[-(rid * 1000 + i) - 1 for i in range(output // BLOCK)])


def prefix_group(request: SimRequest) -> int:
    """The shared-prefix group a `shaped_request` was made for."""
    return (request.hashes[0] - 10_000_000) // 100 if request.hashes else 0


def synthetic(rate_at, span_s: float, seed: int, prompt: int = 256, output: int = 32) -> list[SimRequest]:
    rng = random.Random(seed)
    requests, t, rid = [], 0.0, 0
    peak = max(rate_at(x) for x in range(int(span_s)))
    while t < span_s:  # thinning: a Poisson process of the time-varying rate
        t += rng.expovariate(peak)
        if t < span_s and rng.random() < rate_at(t) / peak:
            requests.append(shaped_request(rid, rng.randrange(8), t, prompt, output))
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


def attainable_ttft_share(requests: list[SimRequest], calibration: Calibration, ttft_slo: float) -> float:
    """The share of requests whose TTFT target any policy could meet: each on an idle replica of
    its own that holds every block an earlier request's prompt or answer wrote (a perfect router
    on an unbounded fleet, no cold start), so its first token waits only for its prompt past the
    longest prefix seen before (at least one token). A request over the target even then is over
    it under every policy, so this bounds every policy's SLO attainment from above."""
    seen: set[int] = set()
    meetable = 0
    for request in sorted(requests, key=lambda r: r.arrival):
        cached_blocks = 0
        for block_hash in request.hashes:
            if block_hash not in seen:
                break
            cached_blocks += 1
        uncached = max(1, request.prompt_tokens - cached_blocks * BLOCK)
        meetable += uncached / calibration.prefill_tokens_per_s <= ttft_slo
        seen.update(request.hashes)
        seen.update(request.answer_hashes)
    return meetable / len(requests)


def slo(requests: list[SimRequest], calibration: Calibration) -> tuple[float, float]:
    prompt_p50 = statistics.median(r.prompt_tokens for r in requests)
    return (max(1.0, 4 * prompt_p50 / calibration.prefill_tokens_per_s), 3 * calibration.decode_step_s)


def compressed_bursty(calibration: Calibration, span: float, seed: int = 1,
                      base_fraction: float = 0.6) -> list[SimRequest]:
    """Level (a)'s arrivals: the bursty workload squeezed into ``span`` seconds: the base rate
    (``base_fraction`` x one replica's capacity), x4 from 25 % to 75 % of the span, the base again."""
    base = base_fraction * one_replica_rps(calibration, 256, 32)

    def rate(t: float) -> float:
        return 4 * base if 0.25 * span <= t < 0.75 * span else base

    return sorted(synthetic(rate, span, seed=seed), key=lambda r: r.arrival)


PROBE_TRACE_SPAN_S = 120.0


PROBE_TRACE_SEED = 2  # the trace's is 1


PROBE_TRACE_GROUP = 60  # its prefix groups are 60-67: the trace's are 0-7, the other probes' 49-53


PROBE_TRACE_RID = 200_000


def probe_trace(calibration: Calibration, base_fraction: float) -> list[SimRequest]:
    """Level (a)'s trace probe: the trace's own arrival process (`compressed_bursty`, the same
    rates) for PROBE_TRACE_SPAN_S, from another seed, with prefix groups and ids of its own. Sent
    to one replica before the trace (the policy held at one replica), it shows what the platform
    adds to a first token (`path_residuals`) and to a decode step (`fitted_per_sequence_cost`)
    under the trace's load, which a probe of spaced requests does not."""
    requests = compressed_bursty(calibration, PROBE_TRACE_SPAN_S, seed=PROBE_TRACE_SEED,
                                 base_fraction=base_fraction)
    return [shaped_request(PROBE_TRACE_RID + r.rid, PROBE_TRACE_GROUP + prefix_group(r), r.arrival,
                           r.prompt_tokens, r.output_tokens) for r in requests]
