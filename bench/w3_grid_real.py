"""The routing grid on a real fleet (bench.w3_grid --mode real): per cell, three `kvscale serve`
replicas sharing one Redis, and in front of them, one after the other on the same replicas,
kvscale's router (default policy), kvscale's round-robin and `vllm-router` cache_aware.

Prompts are text (`vllm-router`'s cache_aware matches text): each group's prefix is words drawn
to about the cell's prefix length in the model's tokens, each request adds its own words. Every
router's run opens its prompts with a number of its own (its place in ``--routers``: as short for
every router, a few tokens, so every router's prompts start a group's prefix in their first block),
so no router finds another's blocks cached: each starts from its own cold caches, on pools the
previous run filled (evictable).
Hit rate is the replicas' own prefix-cache counters over the run; TTFT is the client's (first
streamed token); wall time is the run's. kvscale's routers log their decisions (debug), kept per
run in the JSON with the spill records (kvscale.router.candidates.Spill).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.envoy_gateway import envoy_argv, envoy_config, listener, wait_ready
from bench.stats import quantile
from bench.w3_fleet import (
    MODEL,
    Fleet,
    Processes,
    cache_counters,
    decision_records,
    router_argv,
    start_fleet,
    wait_healthy,
)
from bench.w3_grid_cells import (
    GROUPS,
    OUTPUT_TOKENS,
    PREAMBLE_SEED,
    REPLICAS,
    REQUESTS,
    SUFFIX_TOKENS,
    Cell,
)
from bench.w3_workloads import WORDS, group_order
from kvscale.processes import free_port

# Real routers: name -> how to start it ("kvscale:<policy>", "vllm-router:<policy>", or
# "envoy-epp:<policy>": Envoy asking kvscale's router with <policy> as its endpoint picker).
ROUTERS = ("vllm-router:cache_aware", "kvscale:predicted-ttft", "kvscale:round-robin")
THROTTLED_NICE = 19  # the throttled replica's niceness (the others keep --replica-nice)


def text_of(rng: random.Random, tokenizer: Any, tokens: int) -> str:
    """Random words, ``tokens`` of the model's tokens or one word more."""
    words: list[str] = []
    count = 0
    while count < tokens:
        # Half the tokens still missing in words (a word is one token or more), then one at a time.
        words.extend(rng.choice(WORDS) for _ in range(max((tokens - count) // 2, 1)))
        count = len(tokenizer.encode(" ".join(words), add_special_tokens=False))
    return " ".join(words)


def text_prompts(cell: Cell, seed: int, tokenizer: Any, opening: str) -> list[str]:
    rng = random.Random(seed)
    if cell.preamble_tokens:
        opening = f"{opening}. {text_of(random.Random(seed + PREAMBLE_SEED), tokenizer, cell.preamble_tokens)}"
    prefixes = [text_of(rng, tokenizer, cell.prefix_tokens) for _ in range(GROUPS)]
    order = group_order(rng, GROUPS, REQUESTS, zipf=False, bursty=cell.order == "bursty")
    return [f"{opening}. {prefixes[g]} {text_of(rng, tokenizer, SUFFIX_TOKENS)}" for g in order]


async def _one(client: httpx.AsyncClient, url: str, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"ok": False, "status": response.status_code}
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    end = time.perf_counter()
    router_ms = response.headers.get("x-kvscale-router-ms")
    return {"ok": True, "ttft_s": (first or end) - started, "latency_s": end - started,
            "replica": response.headers.get("x-kvscale-replica"),
            "router_ms": float(router_ms) if router_ms else None}


async def drive(url: str, prompts: list[str], concurrency: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200), limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[dict] = []

        async def worker() -> None:
            while not queue.empty():
                results.append(await _one(client, url, queue.get_nowait()))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def vllm_router_binary() -> str | None:
    """`vllm-router` on the PATH or beside this interpreter (the bench-routing extra)."""
    beside = Path(sys.executable).with_name("vllm-router")
    return shutil.which("vllm-router") or (str(beside) if beside.exists() else None)


def start_router(procs: Processes, spec: str, fleet: Fleet, args: argparse.Namespace, suffix: str = ""
                 ) -> tuple[str, list[subprocess.Popen], str]:
    """The router ``spec`` names in front of ``fleet``: its URL, its processes (started, healthy)
    and its log (named after the spec and ``suffix``). "envoy-epp:<policy>" is Envoy with kvscale's
    router as its endpoint picker (bench.envoy_gateway), the URL Envoy's."""
    kind, _, policy = spec.partition(":")
    kind, _, source = kind.partition("@")  # "kvscale@DIR:policy": the router of another checkout
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = spec.replace(":", "-").replace("@", "-").replace("/", "_") + suffix
    if kind == "vllm-router":
        argv = [vllm_router_binary() or "vllm-router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *fleet.replica_urls, "--log-level", "warning",
                "--prometheus-port", str(free_port())]  # its default port may be taken
    else:
        argv = router_argv(port, fleet, policy, 16, args.seed, 250.0, "debug")
    grpc_port = free_port()
    if kind == "envoy-epp":
        argv += ["--ext-proc-port", str(grpc_port)]
    started = [procs.start(name, argv, nice=args.router_nice, cwd=source or None)]
    wait_healthy([url], started, timeout=300)
    if kind == "envoy-epp":
        admin, gateway = free_port(), free_port()
        config = envoy_config(admin, [listener("gateway", gateway, "picker", "FULL_DUPLEX_STREAMED")],
                              {"picker": grpc_port})
        started.append(procs.start(f"{name}-envoy", envoy_argv(config), nice=args.router_nice))
        wait_ready(admin, started[-1])
        url = f"http://127.0.0.1:{gateway}"
    return url, started, f"{procs.logdir}/{name}.log"


def router_added(ok: list[dict]) -> dict[str, float]:
    """kvscale's own time per request, from the body's last byte to its decision
    (``x-kvscale-router-ms``), p50 and p99 in ms; empty for a router that does not send it."""
    added = [r["router_ms"] for r in ok if r.get("router_ms") is not None]
    if not added:
        return {}
    return {"router_added_ms_p50": quantile(added, 0.5), "router_added_ms_p99": quantile(added, 0.99)}


def run_cell(cell: Cell, args: argparse.Namespace, tokenizer: Any) -> dict:
    """Every router of ``args.routers`` on one fleet for ``cell``, on ``args.streams`` request
    streams (seeds ``args.seed`` on), the routers' order rotated by one each stream so that none
    always runs first on the fleet."""
    redis_binary = shutil.which("redis-server")
    if not redis_binary:
        raise RuntimeError("needs redis-server on the PATH (make system-deps)")
    fleet_args = argparse.Namespace(
        replicas=REPLICAS, block_size=16, num_gpu_blocks_override=cell.blocks_per_replica(),
        max_model_len=max(1024, cell.prefix_tokens + 256), concurrency=cell.concurrency,
        threads=2 if cell.speed == "fast" else args.threads, replica_nice=args.replica_nice)
    procs = Processes()
    specs = args.routers.split(",")
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    try:
        fleet = start_fleet(procs, redis_binary, fleet_args)
        if cell.speed == "throttled":
            os.setpriority(os.PRIO_PROCESS, fleet.replica_procs[0].pid, THROTTLED_NICE)
        wait_healthy(fleet.replica_urls, fleet.replica_procs)
        for stream in range(args.streams):
            turn = stream % len(specs)
            for spec in specs[turn:] + specs[:turn]:
                runs[spec].append(run_router(procs, fleet, cell, spec, args.seed + stream, args, tokenizer,
                                             opening=f"run {specs.index(spec)}"))
    finally:
        procs.stop_all()
    return {"cell": cell.describe(), "policies": {spec: combined(rows) for spec, rows in runs.items()},
            "logdir": procs.logdir}


def run_router(procs: Processes, fleet: Fleet, cell: Cell, spec: str, seed: int, args: argparse.Namespace,
               tokenizer: Any, opening: str) -> dict:
    """One router in front of ``fleet`` on the request stream ``seed``, its prompts opening with
    ``opening``: its figures."""
    url, started, log = start_router(procs, spec, fleet, args, f"-s{seed}")
    time.sleep(2.0)  # heartbeats bind replica ids to URLs
    prompts = text_prompts(cell, seed, tokenizer, opening=opening)
    q0, h0 = cache_counters(fleet.replica_urls)
    load = os.getloadavg()[0]
    results, wall = asyncio.run(drive(url, prompts, cell.concurrency))
    q1, h1 = cache_counters(fleet.replica_urls)
    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft_s"] for r in ok]
    row: dict[str, Any] = {
        "seed": seed, "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p90_s": quantile(ttfts, 0.9), "ttft_p99_s": quantile(ttfts, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts), "wall_s": wall, "requests": len(results),
        "failed": len(results) - len(ok), "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
        **router_added(ok)}
    if spec.startswith(("kvscale", "envoy-epp")):
        decisions = decision_records(log)
        row["spills"] = [d["spill"] for d in decisions if d.get("spill")]
        row["decisions"] = len(decisions)
    print(f"real {cell.name} seed {seed} {spec:24} hit {row['hit_rate']:.3f} p50 {row['ttft_p50_s']:.2f} "
          f"p90 {row['ttft_p90_s']:.2f} wall {wall:.0f}s spills {len(row.get('spills', []))}", flush=True)
    for proc in reversed(started):
        procs.stop(proc)
    return row


# A router's figures over several streams: the median of each (as the simulated grid's).
MEDIAN_FIGURES = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "wall_s",
                  "router_added_ms_p50", "router_added_ms_p99")


def combined(rows: list[dict]) -> dict:
    """One router's figures over its streams: the one stream's own, or the medians of each figure,
    the counts summed, and each stream's figures (``per_seed``, for its own verdict)."""
    if len(rows) == 1:
        return rows[0]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in MEDIAN_FIGURES if all(k in r for r in rows)}
    if all("router_added_ms_p99" in r for r in rows):
        out["router_added_ms_p99_max"] = max(r["router_added_ms_p99"] for r in rows)
    for count in ("requests", "failed", "decisions"):
        if all(count in r for r in rows):
            out[count] = sum(r[count] for r in rows)
    if all("spills" in r for r in rows):
        out["spills"] = [spill for r in rows for spill in r["spills"]]
    out["per_seed"] = [{k: v for k, v in r.items() if k != "spills"} for r in rows]
    return out
