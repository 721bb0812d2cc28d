"""``bench.w3_policy_sim --mode hit-bound``: how high a hit rate W3 allows at all against
round-robin's: the arithmetic ceiling and the simulator-only ``oracle`` policy beside every real
policy, and for each target the policy closest to it."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.common import write_result
from bench.w3_ceilings import hit_ceiling
from bench.w3_sim import Costs
from bench.w3_sim_router import ORACLE
from bench.w3_sim_run import calibration, over_seeds
from bench.w3_workloads import build_workload

# The targets against round-robin, same run: (metric, "higher" or "lower" is better, target).
TARGETS = {
    "hit_rate_ratio": ("higher", 3.0),
    "ttft_p50_better": ("higher", 3.0),
    "ttft_p90_better": ("higher", 1.5),
    "throughput_ratio": ("higher", 1.3),
    "max_over_mean_requests": ("lower", 1.3),
}


def against_round_robin(row: dict, rr: dict) -> dict:
    return {
        "hit_rate_ratio": row["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf"),
        "ttft_p50_better": rr["ttft_p50_s"] / row["ttft_p50_s"],
        "ttft_p90_better": rr["ttft_p90_s"] / row["ttft_p90_s"],
        "throughput_ratio": row["output_tokens_per_s"] / rr["output_tokens_per_s"],
        "max_over_mean_requests": row["max_over_mean_requests"],
    }


def hit_bound(args) -> int:
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    real = json.loads(Path(args.calibration).read_text())
    params, costs, answer_tokens, w4_params = calibration(real)
    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    policies = [ORACLE, *args.policies.split(",")]
    full_params = dict(params, groups=16, prefix_tokens=512, suffix_tokens=16, requests=256, output_tokens=32,
                       concurrency=16)
    full_costs = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 16)
    setups = [
        ("real-run setup", params, dict(replicas=params["replicas"], num_blocks=params["num_gpu_blocks_override"],
                                        block_size=params["block_size"], costs=costs), ("w3", "w3-zipf", "w4")),
        ("issue's full W3", full_params, dict(replicas=4, num_blocks=192, block_size=params["block_size"],
                                              costs=full_costs), ("w3", "w3-zipf")),
    ]
    streams: dict = {}

    def ceiling(kind: str, p: dict) -> float:
        values = []
        for s in range(args.seeds):
            key = (kind, s, json.dumps(p, sort_keys=True, default=str))
            if key not in streams:
                streams[key] = build_workload(kind, p, p["seed"] + s, tokenizer, answer_tokens)
            values.append(hit_ceiling(streams[key], params["block_size"]))
        return statistics.median(values)

    cases = []
    for setup, base, shape, kinds in setups:
        for kind in kinds:
            p = w4_params if kind == "w4" else base
            rows = {policy: over_seeds(kind, p, policy, args.seeds, tokenizer, answer_tokens, streams, **shape)
                    for policy in policies}
            rr = rows["round-robin"]
            case: dict = {"setup": setup, "workload": kind, "hit_ceiling": ceiling(kind, p),
                          "round_robin_hit_rate": rr["hit_rate"]}
            case["hit_ratio_ceiling"] = case["hit_ceiling"] / rr["hit_rate"]
            case["policies"] = {policy: {**row, **against_round_robin(row, rr)} for policy, row in rows.items()}
            real_policies = [q for q in policies if q not in (ORACLE, "round-robin")]
            closest = {}
            for target, (better, goal) in TARGETS.items():
                values = {q: case["policies"][q][target] for q in real_policies}
                best = (max if better == "higher" else min)(values, key=values.__getitem__)
                met = values[best] >= goal if better == "higher" else values[best] <= goal
                closest[target] = {"policy": best, "value": values[best], "target": goal, "met": met}
            for metric in ("ttft_p50_s", "ttft_p90_s"):
                values = {q: case["policies"][q][metric] for q in real_policies}
                closest[f"best_{metric}"] = {"policy": min(values, key=values.__getitem__), "value": min(values.values())}
            case["closest"] = closest
            cases.append(case)
            ours, oracle = case["policies"]["predicted-ttft"], case["policies"][ORACLE]
            print(f"{setup:16} {kind:8} ceiling {case['hit_ceiling']:.3f} (x{case['hit_ratio_ceiling']:.2f} rr)  "
                  f"oracle {oracle['hit_rate']:.3f} (x{oracle['hit_rate_ratio']:.2f}) p50 {oracle['ttft_p50_s']:.2f} "
                  f"p90 {oracle['ttft_p90_s']:.2f}  predicted-ttft {ours['hit_rate']:.3f} "
                  f"(x{ours['hit_rate_ratio']:.2f})  rr {rr['hit_rate']:.3f}", flush=True)
            for target, c in closest.items():
                print(f"    {target:24} {c['policy']:16} {c['value']:.3f}"
                      + (f"  target {c['target']}  {'met' if c['met'] else 'missed'}" if "target" in c else ""))
    # The ratio's bound is the ceiling over round-robin's rate, and round-robin's rate grows with the pool.
    pools = []
    for num_blocks in (int(x) for x in args.bound_pools.split(",")):
        shape = dict(replicas=4, num_blocks=num_blocks, block_size=params["block_size"], costs=full_costs)
        row = {"num_blocks": num_blocks, "prefixes_per_pool": num_blocks * params["block_size"] / 528,
               "hit_ceiling": ceiling("w3", full_params)}
        for policy in (ORACLE, "predicted-ttft", "round-robin"):
            row[policy] = over_seeds("w3", full_params, policy, args.seeds, tokenizer, answer_tokens, streams,
                                     **shape)["hit_rate"]
        row["hit_ratio_ceiling"] = row["hit_ceiling"] / row["round-robin"]
        pools.append(row)
        print(f"pool {num_blocks:>4} blocks ({row['prefixes_per_pool']:.1f} prefixes)  ceiling x{row['hit_ratio_ceiling']:.2f}  "
              f"oracle {row[ORACLE]:.3f}  predicted-ttft {row['predicted-ttft']:.3f}  rr {row['round-robin']:.3f}",
              flush=True)
    path = write_result("w3_policy_sim_hit_bound", {
        "benchmark": "w3_policy_sim", "mode": "hit-bound", "date": time.strftime("%Y-%m-%d"),
        "calibration": {"from": args.calibration, "costs": costs.__dict__, "w4_answer_tokens": answer_tokens},
        "parameters": vars(args), "targets": TARGETS, "cases": cases, "full_w3_pool_sweep": pools,
    }, args.out)
    print(f"w3_policy_sim: wrote {path}")
    return 0
