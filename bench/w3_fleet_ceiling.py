"""Routing near the ceiling, real run: kvscale's router and vLLM's own router in front of the same
kvscale replicas, the same text prompts, the replicas' own counters.

The workload is the issue's "fits in the fleet" shape by default: G groups of requests, each group
sharing a P-token prefix, R requests in random group order, C in flight (closed loop), N replicas
whose KV pools together hold every prefix (160 blocks each). ``--workload does-not-fit`` sends the
same stream to pools of 96 blocks, which together cannot hold every prefix. Prompts are text (words), so that a router that routes
on text (`vllm-router`) takes part on equal terms: kvscale's router tokenizes them as the replicas
do. Each router runs the whole stream once, one after the other, each with its own ``cache_salt``
(no run inherits another's cache while all see identical prompts); the replicas are shared, so each
run starts on pools full of the previous run's blocks, as a fleet in service would.

Per run: the replicas' own prefix-cache hit rate (``vllm:prefix_cache_hits`` over ``queries``, summed
over the replicas), that rate as a share of the workload's ceiling (Belady's MIN over the fleet's
combined KV: ``bench.w3_ceilings.capacity_ceiling``), TTFT p50/p90 as the client sees it,
requests per replica from the replicas' own ``vllm:request_success`` counters (max/mean), wall
time, and the machine's load average before and after.

    python -m bench.w3_fleet_ceiling                       # bench/results/w3_fleet_ceiling.json
    python -m bench.w3_fleet_ceiling --vllm-router /tmp/venv/bin/vllm-router   # adds vLLM's router
    python -m bench.w3_fleet_ceiling --workload does-not-fit   # bench/results/w3_fleet_ceiling_does_not_fit.json

A kvscale policy written ``NAME/cal`` runs that policy with ``--ttft-calibration`` (deciding on the
calibrated estimate). Every answer of predicted-ttft carries its calibrated and raw estimates; both
are set against the TTFT the client measured (``ttft_prediction`` and
``ttft_prediction_uncalibrated``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.roofline import cpu_info
from bench.stats import quantile
from bench.w3_ceilings import capacity_ceiling
from bench.w3_fleet import (
    MODEL,
    Processes,
    replica_counters,
    router_argv,
    start_fleet,
    wait_healthy,
)
from bench.w3_workloads import WORDS, Workload
from kvscale.processes import free_port

REPO = Path(__file__).resolve().parents[1]
KVSCALE_POLICIES = ("predicted-ttft", "weighted", "round-robin")
VLLM_POLICIES = ("cache_aware", "round_robin")
# KV blocks per replica of each workload: 3 x 160 holds the 12 prefixes of 32 blocks with room to
# spare; 3 x 96 holds fewer than the 12 prefixes and their requests' suffixes.
WORKLOAD_BLOCKS = {"fits": 160, "does-not-fit": 96}
# A policy written NAME/cal decides on the calibrated estimate (--ttft-calibration).
CALIBRATED = "/cal"


def text_prompts(tokenizer, seed: int, groups: int, prefix_tokens: int, requests: int,
                 suffix_words: int) -> list[str]:
    """Each group's prefix is random words cut to ``prefix_tokens`` tokens (whole words); every
    request adds its own words after it. Group order is a shuffle of equal shares, as W3's."""
    rng = random.Random(seed)
    prefixes = []
    for _ in range(groups):
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < prefix_tokens:
            words.extend(rng.choice(WORDS) for _ in range(16))
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > prefix_tokens:
            words.pop()
        prefixes.append(" ".join(words))
    order = [i % groups for i in range(requests)]
    rng.shuffle(order)
    return [prefixes[g] + " " + " ".join(rng.choice(WORDS) for _ in range(suffix_words)) + "." for g in order]


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"ok": False, "status": response.status_code}
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                first = time.perf_counter()
    predicted_ms = response.headers.get("x-kvscale-predicted-ttft-ms")
    raw_ms = response.headers.get("x-kvscale-predicted-ttft-uncalibrated-ms")
    return {"ok": True, "ttft_s": (first or time.perf_counter()) - started, "latency_s": time.perf_counter() - started,
            "router_ms": float(response.headers.get("x-kvscale-router-ms", "nan")),
            "replica": response.headers.get("x-kvscale-replica"),
            "predicted_ttft_s": float(predicted_ms) / 1000 if predicted_ms else None,
            "uncalibrated_ttft_s": float(raw_ms) / 1000 if raw_ms else None}


def prediction_error(pairs: list[tuple[float, float]]) -> dict | None:
    """The estimate against the TTFT the client measured: (measured - predicted) and measured /
    predicted, p10 / p50 / p90, and the median absolute log error (0: exact; 0.69: off by 2x)."""
    import math

    if not pairs:
        return None
    errors = [measured - predicted for predicted, measured in pairs]
    ratios = [measured / predicted for predicted, measured in pairs if predicted > 0]
    return {"requests": len(pairs),
            "error_s": {f"p{q}": quantile(errors, q / 100) for q in (10, 50, 90)},
            "measured_over_predicted": {f"p{q}": quantile(ratios, q / 100) for q in (10, 50, 90)},
            "abs_log_error_p50": quantile([abs(math.log(r)) for r in ratios if r > 0], 0.5)}


async def drive(router_url: str, prompts: list[str], args, salt: str) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as client:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        results: list[dict] = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"model": MODEL, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "cache_salt": salt}
                results.append(await _one(client, f"{router_url}/v1/completions", body))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return results, time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(name: str, router_url: str, replica_urls: list[str], prompts: list[str], args, ceiling: float,
            n: int = 0, router_pid: int = 0, replica_pids: tuple[int, ...] = ()) -> dict:
    before = replica_counters(replica_urls)
    load_before = os.getloadavg()[0]
    cpu_before = (cpu_seconds(router_pid), sum(cpu_seconds(p) for p in replica_pids))
    results, wall = asyncio.run(drive(router_url, prompts, args, salt=f"{name}-{args.seed}-{n}"))
    cpu_after = (cpu_seconds(router_pid), sum(cpu_seconds(p) for p in replica_pids))
    after = replica_counters(replica_urls)
    ok = [r for r in results if r["ok"]]
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    per_replica = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    hit_rate = hits / queries if queries else 0.0
    ttfts = [r["ttft_s"] for r in ok]
    router_ms = [r["router_ms"] for r in ok if r["router_ms"] == r["router_ms"]]
    # predicted-ttft's estimate against the TTFT the client measured (which adds the HTTP path),
    # calibrated (what the router decided on, plus the overhead) and raw, on the same requests.
    calibrated = [(r["predicted_ttft_s"], r["ttft_s"]) for r in ok if r.get("predicted_ttft_s")]
    raw = [(r["uncalibrated_ttft_s"], r["ttft_s"]) for r in ok if r.get("uncalibrated_ttft_s")]
    return {
        "ttft_prediction": prediction_error(calibrated),
        "ttft_prediction_uncalibrated": prediction_error(raw),
        "per_request": [{k: r.get(k) for k in ("replica", "ttft_s", "predicted_ttft_s", "uncalibrated_ttft_s")}
                        for r in ok],
        "router": name,
        "pass": n,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "prefix_cache_hit_rate": hit_rate,
        "share_of_ceiling": hit_rate / ceiling if ceiling else float("nan"),
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p90_s": quantile(ttfts, 0.9),
        "wall_s": wall,
        "requests_per_replica": per_replica,
        "max_over_mean_requests": max(per_replica) / statistics.mean(per_replica) if any(per_replica) else float("nan"),
        "router_added_ms_p50": quantile(router_ms, 0.5) if router_ms else None,
        "router_added_ms_p99": quantile(router_ms, 0.99) if router_ms else None,
        "router_cpu_s": round(cpu_after[0] - cpu_before[0], 2),  # the router process's own CPU time
        "replicas_cpu_s": round(cpu_after[1] - cpu_before[1], 2),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }


MEDIAN_KEYS = ("prefix_cache_hit_rate", "share_of_ceiling", "ttft_p50_s", "ttft_p90_s", "wall_s",
               "max_over_mean_requests", "router_added_ms_p50", "router_added_ms_p99", "router_cpu_s",
               "replicas_cpu_s")


def medians(results: list[dict]) -> dict[str, dict]:
    """Per router, the median of each figure over its passes."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["router"] for r in results):
        runs = [r for r in results if r["router"] == name]
        out[name] = {k: statistics.median(r[k] for r in runs) if all(r.get(k) is not None for r in runs) else None
                     for k in MEDIAN_KEYS}
        out[name]["passes"] = len(runs)
        out[name]["failed"] = sum(r["failed"] for r in runs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--suffix-words", type=int, default=8)
    parser.add_argument("--requests", type=int, default=144)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--workload", choices=tuple(WORKLOAD_BLOCKS), default="fits",
                        help="fits: the fleet's pools hold every prefix (160 blocks each); does-not-fit: 96 each")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="KV blocks per replica (default: the workload's)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--replica-nice", type=int, default=10)
    parser.add_argument("--policies", default=",".join(KVSCALE_POLICIES), help="kvscale router policies to run")
    parser.add_argument("--vllm-router", default=None,
                        help="path of a `vllm-router` binary (pip install vllm-router, in a venv of its own)")
    parser.add_argument("--vllm-policies", default=",".join(VLLM_POLICIES))
    parser.add_argument("--passes", type=int, default=1,
                        help="times every router runs the stream (alternating order; medians reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help="default: bench/results/w3_fleet_ceiling.json (fits), w3_fleet_ceiling_does_not_fit.json")
    args = parser.parse_args()
    if args.num_gpu_blocks_override is None:
        args.num_gpu_blocks_override = WORKLOAD_BLOCKS[args.workload]
    if args.out is None:
        suffix = "" if args.workload == "fits" else "_" + args.workload.replace("-", "_")
        args.out = str(REPO / "bench" / "results" / f"w3_fleet_ceiling{suffix}.json")

    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    redis_binary = shutil.which("redis-server")
    if not redis_binary:
        print("w3_fleet_ceiling: needs redis-server on the PATH (make system-deps)", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    prompts = text_prompts(tokenizer, args.seed, args.groups, args.prefix_tokens, args.requests, args.suffix_words)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    clients: list[list] = [[] for _ in range(args.concurrency)]
    for i, prompt_ids in enumerate(ids):
        clients[i % args.concurrency].append((0.0, prompt_ids, [], args.output_tokens))
    ceiling = capacity_ceiling(Workload(clients), args.block_size, args.replicas * args.num_gpu_blocks_override)
    print(f"w3_fleet_ceiling: {args.workload}, {args.replicas} x {args.num_gpu_blocks_override} blocks, {len(prompts)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"ceiling {ceiling:.3f}", flush=True)

    started = time.time()
    host = cpu_info()
    procs = Processes()
    results = []
    try:
        fleet = start_fleet(procs, redis_binary, args)
        replica_urls, replica_procs = fleet.replica_urls, fleet.replica_procs
        routers: list[tuple[str, str, object]] = []
        for policy in [p for p in args.policies.split(",") if p]:
            port = free_port()
            name = policy.removesuffix(CALIBRATED)
            proc = procs.start(f"router-{policy.replace('/', '-')}",
                               router_argv(port, fleet, name, args.block_size, args.seed, 250)
                               + (["--ttft-calibration"] if name != policy else []),
                               nice=-5 if os.geteuid() == 0 else 0)
            routers.append((f"kvscale {policy}", f"http://127.0.0.1:{port}", proc))
        if args.vllm_router:
            for policy in [p for p in args.vllm_policies.split(",") if p]:
                port = free_port()
                proc = procs.start(f"vllm-router-{policy}", [
                    args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--worker-urls", *replica_urls, "--log-level", "warning"])
                routers.append((f"vllm-router {policy}", f"http://127.0.0.1:{port}", proc))
        print(f"w3_fleet_ceiling: {args.replicas} replicas, {len(routers)} routers (logs in {procs.logdir})", flush=True)
        wait_healthy(replica_urls, replica_procs)
        wait_healthy([u for _, u, _ in routers], [p for _, _, p in routers], timeout=300)  # type: ignore[misc]
        time.sleep(3.0)  # heartbeats bind replica ids to URLs; vllm-router checks its workers
        for n in range(args.passes):
            # Every other pass in reverse order: the machine's drift falls on every router alike.
            for name, url, proc in (routers if n % 2 == 0 else routers[::-1]):
                row = run_one(name, url, replica_urls, prompts, args, ceiling, n, proc.pid,  # type: ignore[attr-defined]
                              tuple(p.pid for p in replica_procs))
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "per_request"}), flush=True)
    finally:
        procs.stop_all()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    by = medians(results)
    default = by.get("kvscale predicted-ttft")
    summary = {}
    if default:
        for name, r in by.items():
            if name != "kvscale predicted-ttft":
                summary[f"default_vs_{name}"] = {
                    "hit_rate": default["prefix_cache_hit_rate"] / r["prefix_cache_hit_rate"]
                    if r["prefix_cache_hit_rate"] else float("inf"),
                    "ttft_p50_ratio": default["ttft_p50_s"] / r["ttft_p50_s"],
                    "ttft_p90_ratio": default["ttft_p90_s"] / r["ttft_p90_s"],
                    "wall_ratio": default["wall_s"] / r["wall_s"],
                }
    out.write_text(json.dumps({
        "benchmark": "w3_fleet_ceiling", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": host, "parameters": vars(args), "ceiling": ceiling, "results": results, "medians": by,
        "summary": summary,
        "elapsed_s": time.time() - started,
    }, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"w3_fleet_ceiling: wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
