"""Routing policies, simulated: a calibrated model of the real run, then policies compared in seconds.

Two modes.

``--mode calibrated`` (default). Each replica is a continuous-batching engine: FCFS, a token budget
per step, prompt blocks findable when scheduled, an LRU KV pool of the real size in blocks, answer
blocks cached as they are decoded. A step costs ``decode_step_s`` if anything decodes (plus
``decode_step_per_seq_s`` per sequence beyond the first, where a calibration measured it) plus its
prompt tokens over ``prefill_tokens_per_s``: the two figures are taken from a real run's own
heartbeats (``bench.w3_router`` samples them; ``--calibration`` names its JSON). The simulated
router is the real one's decision functions (``kvscale.router.policy``) fed what the real router
sees (prefix matches from the index incl. its predictions, in-flight requests, queued prefill
tokens, decodes, KV usage), except that it sees queues exactly where the real router reads
heartbeats up to a second old and corrects them with its own sends. The request streams are
``bench.w3_workloads``' (same seeds as the real run; W4 prompts are built with the real chat
template, answers are filler of the measured length). First the real run's setup is replayed and
its TTFT p50/p90 per (workload, policy) compared with the measured ones (the agreement), then a grid
of pool sizes, concurrency levels and workloads compares the policies.

``--mode hit-bound``: how high a hit rate W3 allows at all, against round-robin's. Two bounds: the
arithmetic ceiling (a request can reuse only blocks some earlier request computed, so every
group's first request misses whatever the policy) and ``oracle``, a simulator-only policy that
sends every request to the replica truly holding (cached, or queued to compute) the longest
prefix of it, ignoring load, cold prompts by consistent hashing. Every policy runs beside them
on the real run's setup and on the issue's full W3, plus a pool-size sweep at full size, and for
each of the issue's targets the policy closest to it is named.

``--mode ceiling``: each policy's hit rate as a fraction of the workload's ceiling, the best hit rate
any assignment of requests to replicas could reach with the same KV capacities: Belady's optimal
eviction (MIN) over one pool of the fleet's combined size, on the arrival-ordered requests (a fleet
of separate pools can only do worse: a copy of a block on a second replica takes room, never adds
a hit), counted as the engine counts hits (leading blocks, never a prompt's last token). For W3,
W3-Zipf and W4 at the real run's setup, the issue's full W3, a workload whose hot prefixes fit in
the fleet (12 groups x 512-token prefix, 144 requests, 8 in flight, 3 replicas x 160 blocks) and the
same stream on pools too small to hold them (3 x 96 blocks).

``--mode epsilon-grid``: the earlier hit-rate study of the bounded-load rule (prefix-affinity
against round-robin by epsilon and pool size; W3's stream, an LRU of whole prefixes, invented
service times).

    python -m bench.w3_policy_sim --calibration bench/results/w3_router_ttft.json
    python -m bench.w3_policy_sim --mode hit-bound     # bench/results/w3_policy_sim_hit_bound.json
    python -m bench.w3_policy_sim --mode ceiling       # bench/results/w3_policy_sim_ceiling.json
    python -m bench.w3_policy_sim --mode epsilon-grid --out bench/results/w3_policy_sim.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import write_result
from bench.w3_ceilings import ceiling_mode
from bench.w3_epsilon_grid import epsilon_grid
from bench.w3_hit_bound import hit_bound
from bench.w3_sim import Costs
from bench.w3_sim_run import calibration, over_seeds, simulate_run
from bench.w3_workloads import Workload, build_workload


def calibrated(args) -> int:
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    real = json.loads(Path(args.calibration).read_text())
    params, costs, answer_tokens, w4_params = calibration(real)
    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    shape = dict(replicas=params["replicas"], num_blocks=params["num_gpu_blocks_override"],
                 block_size=params["block_size"], costs=costs)
    agreement = []
    workloads: dict[str, Workload] = {}
    for r in real["results"]:
        kind = r["workload"]
        if kind not in workloads:
            workloads[kind] = build_workload(kind, w4_params if kind == "w4" else params, params["seed"], tokenizer,
                                             answer_tokens)
        # Each real run is replayed with the rates its own replicas measured while it ran.
        own = r["replica_rates"]
        run_costs = Costs(own["prefill_tokens_per_s_median"] or costs.prefill_tokens_per_s,
                          own["decode_step_s_median"] or costs.decode_step_s, costs.step_tokens, costs.max_num_seqs)
        sim = simulate_run(workloads[kind], r["policy"], seed=params["seed"], **dict(shape, costs=run_costs))
        row = {"workload": kind, "policy": r["policy"], "costs": run_costs.__dict__,
               "real": {k: r[k] for k in ("ttft_p50_s", "ttft_p90_s", "prefix_cache_hit_rate", "output_tokens_per_s")},
               "sim": {k: sim[k] for k in ("ttft_p50_s", "ttft_p90_s", "hit_rate", "output_tokens_per_s")}}
        row["p50_ratio_sim_over_real"] = sim["ttft_p50_s"] / r["ttft_p50_s"]
        row["p90_ratio_sim_over_real"] = sim["ttft_p90_s"] / r["ttft_p90_s"]
        agreement.append(row)
        print(f"agree {kind:8} {r['policy']:16} TTFT p50 real {r['ttft_p50_s']:.2f} sim {sim['ttft_p50_s']:.2f}  "
              f"p90 real {r['ttft_p90_s']:.2f} sim {sim['ttft_p90_s']:.2f}  hit real "
              f"{r['prefix_cache_hit_rate']:.2f} sim {sim['hit_rate']:.2f}", flush=True)

    # The grid: policies in seconds across pool sizes, concurrency and workloads, same costs.
    grid = []
    streams: dict = {}
    policies = args.policies.split(",")
    for replicas in (int(x) for x in args.pools.split(",")):
        for per_replica in (int(x) for x in args.concurrency_per_replica.split(",")):
            p = dict(params, concurrency=replicas * per_replica, groups=params["groups"] * replicas // params["replicas"],
                     requests=args.grid_requests_per_replica * replicas,
                     conversations=args.grid_conversations_per_replica * replicas)
            cost = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, max(per_replica * 2, 4))
            for kind in args.grid_workloads.split(","):
                for policy in policies:
                    row = {"replicas": replicas, "concurrency": replicas * per_replica, "workload": kind,
                           "policy": policy}
                    row.update(over_seeds(kind, p, policy, args.seeds, tokenizer, answer_tokens, streams,
                                          replicas=replicas, num_blocks=params["num_gpu_blocks_override"],
                                          block_size=params["block_size"], costs=cost))
                    grid.append(row)
                    print(f"grid n={replicas:<3} C={replicas * per_replica:<3} {kind:8} {policy:16} hit {row['hit_rate']:.2f} "
                          f"p50 {row['ttft_p50_s']:.2f} p90 {row['ttft_p90_s']:.2f} tok/s {row['output_tokens_per_s']:.1f} "
                          f"max/mean {row['max_over_mean_requests']:.2f}", flush=True)
    # Unequal replicas (e.g. two GPU generations in one pool): speeds x1.5, x1, x1, x0.5 of the calibrated
    # costs. Only predicted-ttft reads each replica's measured rates.
    hetero = []
    speeds = [float(x) for x in args.hetero_speeds.split(",")]
    pool_costs = [Costs(costs.prefill_tokens_per_s * f, costs.decode_step_s / f, costs.step_tokens, costs.max_num_seqs)
                  for f in speeds]
    for kind in args.grid_workloads.split(","):
        for policy in policies:
            row = {"speeds": speeds, "workload": kind, "policy": policy}
            row.update(over_seeds(kind, w4_params if kind == "w4" else params, policy, args.seeds, tokenizer,
                                  answer_tokens, streams, **dict(shape, replicas=len(speeds), costs=pool_costs)))
            hetero.append(row)
            print(f"hetero {kind:8} {policy:16} hit {row['hit_rate']:.2f} p50 {row['ttft_p50_s']:.2f} "
                  f"p90 {row['ttft_p90_s']:.2f} tok/s {row['output_tokens_per_s']:.1f}", flush=True)

    # What bounds the W3 targets at the real run's size: every group's first request is a cold miss
    # under any policy, so vary how many requests share the groups (same pool, same costs).
    sweep = []
    for requests in (int(x) for x in args.sweep_requests.split(",")):
        p = dict(params, requests=requests)
        row: dict = {"requests": requests, "cold_miss_share": params["groups"] / requests}
        for policy in ("predicted-ttft", "round-robin"):
            row[policy] = over_seeds("w3", p, policy, args.seeds, tokenizer, answer_tokens, streams, **shape)
        ours, rr = row["predicted-ttft"], row["round-robin"]
        row["hit_rate_ratio"] = ours["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
        row["ttft_p50_better"] = rr["ttft_p50_s"] / ours["ttft_p50_s"]
        row["ttft_p90_better"] = rr["ttft_p90_s"] / ours["ttft_p90_s"]
        row["throughput_ratio"] = ours["output_tokens_per_s"] / rr["output_tokens_per_s"]
        sweep.append(row)
        print(f"sweep W3 R={requests:<4} cold {row['cold_miss_share']:.2f}  hit x{row['hit_rate_ratio']:.2f}  "
              f"p50 x{row['ttft_p50_better']:.2f}  p90 x{row['ttft_p90_better']:.2f}  "
              f"tput x{row['throughput_ratio']:.2f}", flush=True)
    # The full W3 (16 groups of 512 tokens, 256 requests, 32 output tokens, 16 in flight,
    # 192-block pools) at the calibrated costs: the size this machine cannot run in ten minutes.
    full = []
    full_params = dict(params, groups=16, prefix_tokens=512, suffix_tokens=16, requests=256, output_tokens=32,
                       concurrency=16)
    for kind in ("w3", "w3-zipf"):
        for policy in policies:
            row = {"workload": kind, "policy": policy}
            row.update(over_seeds(kind, full_params, policy, args.seeds, tokenizer, answer_tokens, streams,
                                  replicas=4, num_blocks=192, block_size=params["block_size"],
                                  costs=Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 16)))
            full.append(row)
            print(f"full {kind:8} {policy:16} hit {row['hit_rate']:.2f} p50 {row['ttft_p50_s']:.2f} "
                  f"p90 {row['ttft_p90_s']:.2f} tok/s {row['output_tokens_per_s']:.1f} "
                  f"max/mean {row['max_over_mean_requests']:.2f}", flush=True)
    path = write_result("w3_policy_sim_calibrated", {
        "benchmark": "w3_policy_sim", "mode": "calibrated", "date": time.strftime("%Y-%m-%d"),
        "calibration": {"from": args.calibration, "costs": costs.__dict__, "w4_answer_tokens": answer_tokens},
        "parameters": vars(args), "agreement": agreement, "grid": grid, "w3_requests_sweep": sweep,
        "heterogeneous_pool": hetero, "full_w3": full,
    }, args.out)
    print(f"w3_policy_sim: wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("calibrated", "hit-bound", "ceiling", "epsilon-grid"),
                        default="calibrated")
    parser.add_argument("--calibration", default="bench/results/w3_router_ttft.json",
                        help="a bench.w3_router JSON: its setup is replayed and its heartbeat rates are the costs")
    parser.add_argument("--policies", default="predicted-ttft,prefix-affinity,weighted,round-robin,least-load")
    parser.add_argument("--pools", default="4,8,16")
    parser.add_argument("--concurrency-per-replica", default="2,4")
    parser.add_argument("--grid-workloads", default="w3,w3-zipf,w4")
    parser.add_argument("--grid-requests-per-replica", type=int, default=24)
    parser.add_argument("--grid-conversations-per-replica", type=int, default=4)
    parser.add_argument("--hetero-speeds", default="1.5,1,1,0.5", help="relative replica speeds of the unequal pool")
    parser.add_argument("--sweep-requests", default="64,128,256,512",
                        help="W3 at the real run's setup with this many requests (fewer cold misses)")
    parser.add_argument("--bound-pools", default="96,144,192,288,384",
                        help="hit-bound: KV blocks per replica swept at the issue's full W3")
    # epsilon-grid mode
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--epsilons", default="0.25,0.5,1.0")
    parser.add_argument("--capacities", default="4.5,5.8,7,8.7",
                        help="prefixes per replica's pool (W3's 192 blocks of 16 hold 5.8 of 528 tokens)")
    parser.add_argument("--seeds", type=int, default=5, help="request streams (workload seeds) per point")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.mode == "calibrated":
        return calibrated(args)
    if args.mode == "hit-bound":
        return hit_bound(args)
    if args.mode == "ceiling":
        return ceiling_mode(args)
    return epsilon_grid(args)


if __name__ == "__main__":
    raise SystemExit(main())
