"""Why a policy loses a prefix's affinity, from its own decisions: the simulated fleet
(bench.w3_sim) run on one workload, every decision recorded against what was true.

Per request, one of:
- ``kept``: sent to a replica holding the longest prefix any replica truly held (cached, or queued
  to compute), or nobody held any of it;
- ``spill``: the policy saw the holder and passed it over (its estimate, the best other's, the
  prefill the hit would have saved: ``kvscale.router.candidates.Spill``);
- ``blind``: the index matched less than a replica truly held: the router's predictions had
  expired (or never existed) before the replica's KV events confirmed the blocks;
and for each class, the KV blocks its admissions evicted that a later request of the same prefix
wanted (hot blocks lost).

    python -m bench.w3_spill_log                       # the W3-lite shape on a slow fleet
    python -m bench.w3_spill_log --prefill-tokens-per-s 200 --decode-step-s 0.13   # a faster one
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from bench.w3_sim import Costs, SimRequest
from bench.w3_sim_run import simulate_run
from bench.w3_workloads import build_workload

# The held-out W3-lite shape: 12 groups of 512-token prefixes that fit in 3 x 160 blocks.
W3_LITE = dict(groups=12, prefix_tokens=512, suffix_tokens=32, requests=144, output_tokens=8,
               concurrency=8, seed=0)


def classify(req: SimRequest) -> str:
    rec = req.record
    if "spill" in rec:
        return "spill"
    if rec.get("index_best", 0) < rec.get("true_best", 0) and rec.get("true_chosen", 0) < rec["true_best"]:
        return "blind"
    return "kept"


def spill_log(requests: list[SimRequest]) -> dict:
    """The classes' counts, hot blocks each class evicted, and every spill's record."""
    wanted_later: dict[int, set[int]] = {}  # request id -> hashes requested after it
    seen: set[int] = set()
    for req in reversed(requests):
        wanted_later[req.rid] = set(seen)
        seen.update(req.hashes)
    classes: Counter[str] = Counter()
    hot_evicted: Counter[str] = Counter()
    hit_tokens: Counter[str] = Counter()
    spills = []
    for req in requests:
        kind = classify(req)
        classes[kind] += 1
        hit_tokens[kind] += req.hit_tokens
        hot_evicted[kind] += sum(1 for h in req.evicted if h in wanted_later[req.rid])
        if kind == "spill":
            spills.append({"t": round(req.arrival, 2), **req.record["spill"],
                           "hot_blocks_evicted": sum(1 for h in req.evicted if h in wanted_later[req.rid]),
                           "ttft_s": round((req.first_token or 0) - req.arrival, 2)})
    return {"classes": dict(classes), "hot_blocks_evicted": dict(hot_evicted),
            "hit_tokens": dict(hit_tokens), "spills": spills}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="predicted-ttft")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=45.0,
                        help="the issue's fleet: three engines on two cores (about 20 s a request)")
    parser.add_argument("--decode-step-s", type=float, default=0.5)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat-queue", action="store_true",
                        help="replicas report as real ones: queues as heartbeats count them (cached-now "
                             "only), heartbeats and KV events as each step ends, blocks freed tail first")
    parser.add_argument("--show", type=int, default=8, help="spill records printed")
    args = parser.parse_args()
    workload = build_workload("w3", dict(W3_LITE, seed=args.seed), args.seed)
    costs = Costs(args.prefill_tokens_per_s, args.decode_step_s, 2048, W3_LITE["concurrency"])
    run = simulate_run(workload, args.policy, replicas=args.replicas, num_blocks=args.num_blocks,
                       block_size=16, costs=costs, seed=args.seed, details=True,
                       heartbeat_queue=args.heartbeat_queue)
    log = spill_log(run.pop("requests_detail"))
    print(json.dumps({"policy": args.policy, "costs": costs.__dict__, **run,
                      **{k: v for k, v in log.items() if k != "spills"}}, indent=1))
    for spill in log["spills"][: args.show]:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in spill.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
