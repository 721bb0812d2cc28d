"""W3: shared-prefix groups behind the router; prefix-affinity vs round-robin vs random, one run.

N replicas of the bundled model with small KV pools (so eviction matters) and one Redis; for
each policy a fresh router and fresh prefixes (so no policy inherits another's cache), G groups
each with its own P-token prefix, R requests in random interleaving, O output tokens, C in
flight. Per policy: aggregate prefix-cache hit rate (from the replicas' own counters), TTFT
p50/p90, output throughput, max/mean requests per replica, router-added latency p50/p99 (the
router's own time from request received to request sent upstream, reported per response).

    python -m bench.w3_router                      # the issue's W3
    python -m bench.w3_router --requests 96 ...    # scaled down; the JSON records the parameters
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import quantile
from kvscale.processes import free_port

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
# "NAME@EPS" runs policy NAME with --balance-epsilon EPS (the router's default is 0.25).
POLICIES = ("prefix-affinity", "round-robin", "random", "prefix-affinity@0.5")


class Processes:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = tempfile.mkdtemp(prefix="kvscale-w3-")

    def start(self, name: str, argv: list[str], nice: int = 0, env: dict[str, str] | None = None) -> subprocess.Popen:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        log = open(os.path.join(self.logdir, f"{name}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a process exited with {proc.returncode} during startup")
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy: {pending}")
        time.sleep(0.5)


def cache_counters(replica_urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for url in replica_urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for line in text.splitlines():
            match = re.match(r"^(vllm:prefix_cache_(?:queries|hits)_total)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
            if match:
                if match.group(1).endswith("queries_total"):
                    queries += float(match.group(3))
                else:
                    hits += float(match.group(3))
    return queries, hits


def workload(seed: int, groups: int, prefix_tokens: int, requests: int, suffix_tokens: int) -> list[list[int]]:
    """Token-id prompts: each group's random prefix plus a unique suffix, randomly interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(prefix_tokens)] for _ in range(groups)]
    order = [i % groups for i in range(requests)]
    rng.shuffle(order)
    return [prefixes[g] + [rng.randrange(1000, 40000) for _ in range(suffix_tokens)] for g in order]


async def one_request(client: httpx.AsyncClient, router_url: str, prompt: list[int], output_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", f"{router_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"ok": False, "status": response.status_code}
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
        return {
            "ok": True,
            "ttft_s": (first or time.perf_counter()) - started,
            "latency_s": time.perf_counter() - started,
            "replica": response.headers.get("x-kvscale-replica"),
            "router_ms": float(response.headers.get("x-kvscale-router-ms", "nan")),
            "predicted_hit_tokens": int(response.headers.get("x-kvscale-predicted-hit-tokens", "0")),
        }


async def drive(router_url: str, prompts: list[list[int]], output_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        results: list[dict] = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                results.append(await one_request(client, router_url, prompt, output_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def run_policy(args, policy: str, seed: int, replica_urls: list[str], redis_url: str, procs: Processes) -> dict:
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    name, _, epsilon = policy.partition("@")
    router = procs.start(
        f"router-{policy}",
        [sys.executable, "-m", "kvscale", "router", "--host", "127.0.0.1", "--port", str(port),
         "--replicas", ",".join(replica_urls), "--redis", redis_url, "--policy", name,
         "--block-size", str(args.block_size), "--seed", str(seed), "--log-level", "warning"]
        + (["--balance-epsilon", epsilon] if epsilon else []),
    )
    try:
        wait_healthy([router_url], [router], timeout=300)
        time.sleep(1.5)  # heartbeats bound replica ids to URLs
        prompts = workload(seed, args.groups, args.prefix_tokens, args.requests, args.suffix_tokens)
        q0, h0 = cache_counters(replica_urls)
        results, wall = asyncio.run(drive(router_url, prompts, args.output_tokens, args.concurrency))
        q1, h1 = cache_counters(replica_urls)
    finally:
        procs.stop(router)
    ok = [r for r in results if r["ok"]]
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    counts = [per_replica.get(f"replica-{i}", 0) for i in range(args.replicas)]
    mean = statistics.mean(counts)
    ttfts = [r["ttft_s"] for r in ok]
    router_ms = [r["router_ms"] for r in ok]
    return {
        "policy": policy,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "prefix_cache_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "prefix_cache_queries_tokens": q1 - q0,
        "prefix_cache_hits_tokens": h1 - h0,
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p90_s": quantile(ttfts, 0.9),
        "latency_p50_s": quantile([r["latency_s"] for r in ok], 0.5),
        "output_tokens_per_s": len(ok) * args.output_tokens / wall,
        "wall_s": wall,
        "requests_per_replica": counts,
        "max_over_mean_requests": max(counts) / mean if mean else float("nan"),
        "router_added_ms_p50": quantile(router_ms, 0.5),
        "router_added_ms_p99": quantile(router_ms, 0.99),
        "predicted_hit_tokens_total": sum(r["predicted_hit_tokens"] for r in ok),
        # In completion order, for looking into the tails.
        "per_request": [
            {k: r[k] for k in ("ttft_s", "replica", "router_ms", "predicted_hit_tokens")} for r in ok
        ],
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["tab:green" if n.startswith("prefix-affinity") else "tab:gray" for n in names]
    left.bar(names, [100 * r["prefix_cache_hit_rate"] for r in results], color=colors)
    left.tick_params(axis="x", labelrotation=20)
    left.set_ylabel("prefix-cache hit rate (%)")
    left.set_title("W3: replicas' own prefix-cache hit rate")
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in results], width=0.4, label="p50")
    right.bar([i + 0.2 for i in x], [r["ttft_p90_s"] for r in results], width=0.4, label="p90")
    right.set_xticks(list(x), names, rotation=20)
    right.set_ylabel("time to first token (s)")
    right.set_title("W3: TTFT by routing policy")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=192, help="KV blocks per replica")
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
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "w3_router.json"))
    args = parser.parse_args()

    redis_binary = shutil.which("redis-server")
    if not redis_binary:
        print("w3_router: needs redis-server on the PATH (make system-deps)", file=sys.stderr)
        return 2
    procs = Processes()
    started = time.time()
    try:
        redis_port = free_port()
        procs.start("redis", [redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", procs.logdir])
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        replica_urls, replica_procs = [], []
        max_len = args.prefix_tokens + args.suffix_tokens + args.output_tokens + 16
        for i in range(args.replicas):
            port = free_port()
            replica_urls.append(f"http://127.0.0.1:{port}")
            replica_procs.append(procs.start(
                f"replica-{i}",
                [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--block-size", str(args.block_size), "--num-gpu-blocks-override", str(args.num_gpu_blocks_override),
                 "--max-model-len", str(max_len), "--max-num-seqs", str(args.concurrency),
                 "--redis", redis_url, "--replica-id", f"replica-{i}", "--disable-uvicorn-access-log"]
                + ([] if args.max_num_batched_tokens is None
                   else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]),
                nice=args.replica_nice, env={"OMP_NUM_THREADS": str(args.threads)},
            ))
        print(f"w3_router: starting {args.replicas} replicas (logs in {procs.logdir})", flush=True)
        wait_healthy(replica_urls, replica_procs)
        results = []
        for n, policy in enumerate(args.policies.split(",")):
            # A fresh seed per policy: fresh prefixes, so nobody inherits another policy's cache.
            result = run_policy(args, policy, args.seed + 1000 * (n + 1), replica_urls, redis_url, procs)
            print(json.dumps({k: v for k, v in result.items() if k != "per_request"}), flush=True)
            results.append(result)
    finally:
        procs.stop_all()

    by_policy = {r["policy"]: r for r in results}
    summary = {}
    rr = by_policy.get("round-robin")
    for name, pa in by_policy.items():
        if not name.startswith("prefix-affinity") or rr is None:
            continue
        summary[name] = {
            "hit_rate_vs_round_robin": pa["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"]
            if rr["prefix_cache_hit_rate"] else float("inf"),
            "ttft_p90_speedup_vs_round_robin": rr["ttft_p90_s"] / pa["ttft_p90_s"],
            "ttft_p50_speedup_vs_round_robin": rr["ttft_p50_s"] / pa["ttft_p50_s"],
            "output_throughput_vs_round_robin": pa["output_tokens_per_s"] / rr["output_tokens_per_s"],
            "max_over_mean_requests": pa["max_over_mean_requests"],
            "router_added_ms_p99": pa["router_added_ms_p99"],
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "w3_router",
        "date": time.strftime("%Y-%m-%d", time.localtime(started)),
        "machine": f"{os.cpu_count()} CPU cores, no GPU (shared)",
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
