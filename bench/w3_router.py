"""W3, W3-Zipf and W4 behind the router: every routing policy on the same request streams, one run.

N replicas of the bundled model with small KV pools (so eviction matters), one Redis, and one
router per policy (all started up front). For each workload, each policy replays the same request
stream (same seed) with its own ``cache_salt``, so no policy inherits another's cache while all see
identical prompts. Policies run one after the other, in an order rotated per workload; a shared
machine's speed drifts meanwhile, so each run also records the rates its replicas measured, and
the simulator replays every run at its own rates. (``--blocks N`` interleaves policies in N
slices instead, valid only with pools large enough to keep every policy's cache.) Per (workload,
policy): the replicas' own prefix-cache hit rate and its share of the ceiling (the best hit rate any
routing could reach with the fleet's KV, on the token ids that run sent), TTFT p50/p90,
output throughput, max/mean requests per replica, router-added latency p50/p99 (the router's own
time from a request's last byte to sending it upstream, reported per response), and the replicas'
measured rates from their heartbeats (prefill tokens/s, decode step time), which calibrate the
simulator (bench.w3_policy_sim).

    python -m bench.w3_router                          # the recorded run (about 10 minutes here)
    python -m bench.w3_router --workloads w3 --requests 32 ...   # smaller; the JSON records parameters
    python -m bench.w3_router --policies predicted-ttft,envoy-epp:predicted-ttft   # and through Envoy

A policy ``envoy-epp:<policy>`` is Envoy in front (bench.envoy_gateway), asking a router with that
policy as its endpoint picker: the same decisions, with the gateway doing the proxying.

Its parts: the fleet (bench.w3_fleet), the clients (bench.w3_router_client), the report
(bench.w3_router_report).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from bench.envoy_gateway import envoy_argv, envoy_config, listener, wait_ready
from bench.w3_fleet import (
    REPO,
    HeartbeatSampler,
    Processes,
    decision_records,
    router_argv,
    start_fleet,
    wait_healthy,
)
from bench.w3_router_client import run_block, workload_items
from bench.w3_router_report import plot, ratios, run_ceiling, summarize
from bench.w3_workloads import WORKLOADS
from kvscale.processes import free_port

# "NAME@EPS" runs policy NAME with --balance-epsilon EPS (the router's default is 0.25).
POLICIES = ("predicted-ttft", "prefix-affinity", "weighted", "round-robin")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=128)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="requests per W3 / W3-Zipf run")
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8, help="W4 conversations per run (3-6 turns each)")
    parser.add_argument("--document-words", type=int, default=60, help="W4: turn 1's document, in words")
    parser.add_argument("--question-words", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=8, help="W4: max tokens per answer")
    parser.add_argument("--think-min-s", type=float, default=0.2)
    parser.add_argument("--think-max-s", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--blocks", type=int, default=1,
        help="slices of each stream, each run through every policy in turn (spreads machine drift). Only "
        "meaningful when the KV pools hold every policy's working set: otherwise each policy's next slice "
        "finds its cache evicted by the others' (a 4-block run at the defaults halved every hit rate)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=48, help="KV blocks per replica")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the replicas' token budget per step (default: the engine's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per replica (OMP_NUM_THREADS): four replicas share the cores")
    parser.add_argument(
        "--replica-nice", type=int, default=10,
        help="CPU niceness of the replicas. In a cluster the router has CPUs of its own and the replicas "
        "compute on GPUs; here four CPU-bound replicas share the router's cores, and without this the "
        "router's latency measures the kernel's time slices, not the router (0 to measure that anyway).",
    )
    parser.add_argument(
        "--router-nice", type=int, default=-5,
        help="CPU niceness of the routers: they stand in for router pods with CPUs of their own; on a shared "
        "machine other users' processes would otherwise preempt them mid-decision (0 to measure that anyway)",
    )
    parser.add_argument("--router-redis-timeout-ms", type=float, default=250.0,
                        help="the routers' --redis-timeout-ms (50 by default) on this overloaded machine")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decision-log", action="store_true",
                        help="routers log every decision (debug); the JSON keeps each policy's records")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "w3_router_ttft.json"))
    args = parser.parse_args()

    redis_binary = shutil.which("redis-server")
    if not redis_binary:
        print("w3_router: needs redis-server on the PATH (make system-deps)", file=sys.stderr)
        return 2
    from bench.roofline import cpu_info
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    procs = Processes()
    started = time.time()
    host = cpu_info()
    policies = args.policies.split(",")
    results: list[dict] = []
    sampler = None
    try:
        fleet = start_fleet(procs, redis_binary, args, [] if args.max_num_batched_tokens is None
                            else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)])
        replica_urls, replica_procs = fleet.replica_urls, fleet.replica_procs
        routers: dict[str, str] = {}
        router_procs = []
        pickers: dict[str, int] = {}  # "envoy-epp:<policy>": Envoy in front, the router its picker
        for policy in policies:
            port = free_port()
            kind, _, spec = policy.rpartition(":")
            name, _, epsilon = spec.partition("@")
            routers[policy] = f"http://127.0.0.1:{port}"
            if kind == "envoy-epp":
                pickers[policy] = free_port()
            router_procs.append(procs.start(
                f"router-{policy}",
                router_argv(port, fleet, name, args.block_size, args.seed, args.router_redis_timeout_ms,
                            "debug" if args.decision_log else "warning")
                + (["--balance-epsilon", epsilon] if epsilon else [])
                + (["--ext-proc-port", str(pickers[policy])] if policy in pickers else []),
                nice=args.router_nice,
            ))
        print(f"w3_router: starting {args.replicas} replicas and {len(policies)} routers (logs in {procs.logdir})",
              flush=True)
        wait_healthy(replica_urls, replica_procs)
        wait_healthy(list(routers.values()), router_procs, timeout=300)
        for policy, grpc_port in pickers.items():
            admin, gateway = free_port(), free_port()
            config = envoy_config(admin, [listener("gateway", gateway, "picker", "FULL_DUPLEX_STREAMED")],
                                  {"picker": grpc_port})
            wait_ready(admin, procs.start(f"envoy-{policy}", envoy_argv(config), nice=args.router_nice))
            routers[policy] = f"http://127.0.0.1:{gateway}"
        time.sleep(2.0)  # heartbeats bind replica ids to URLs in every router
        sampler = HeartbeatSampler(fleet.redis_url)
        sampler.start()
        for w, workload in enumerate(args.workloads.split(",")):
            items = workload_items(args, workload)
            # The stream in blocks, each block through every policy in a rotating order: the machine's
            # speed drifts (it is shared), and this spreads the drift over all policies alike.
            size = -(-len(items) // args.blocks)
            blocks = [items[i:i + size] for i in range(0, len(items), size)]
            done: dict[str, list[dict]] = {policy: [] for policy in policies}
            for b, block in enumerate(blocks):
                # Rotated per workload and block so that no policy always runs first.
                k = (w + b) % len(policies)
                for policy in policies[k:] + policies[:k]:
                    done[policy].append(run_block(args, workload, policy, routers[policy], replica_urls, block))
            for policy in policies:
                parts = done[policy]
                sent = [r for part in parts for r in part["results"]]
                record = summarize(args, workload, policy, sent,
                                   sum(part["wall"] for part in parts),
                                   (0.0, sum(part["queries"] for part in parts)),
                                   (0.0, sum(part["hits"] for part in parts)))
                record["ceiling"] = run_ceiling(args, sent, tokenizer)
                record["share_of_ceiling"] = (record["prefix_cache_hit_rate"] / record["ceiling"]
                                              if record["ceiling"] else float("nan"))
                record["replica_rates"] = sampler.summary([part["window"] for part in parts])
                record["loadavg_1m_before"] = round(parts[0]["loadavg"][0], 2)
                record["loadavg_1m_after"] = round(parts[-1]["loadavg"][1], 2)
                if args.decision_log:
                    record["decisions"] = decision_records(f"{procs.logdir}/router-{policy}.log")
                print(json.dumps({k: v for k, v in record.items() if k != "per_request"}), flush=True)
                results.append(record)
    finally:
        if sampler is not None:
            sampler.stop()
        procs.stop_all()

    summary = ratios(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "w3_router",
        "date": time.strftime("%Y-%m-%d", time.localtime(started)),
        "machine": host,
        "parameters": vars(args),
        "results": results,
        "summary": summary,
        "elapsed_s": time.time() - started,
    }
    out.write_text(json.dumps(record, indent=2))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    print(f"w3_router: wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
