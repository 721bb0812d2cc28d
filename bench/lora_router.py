"""bench.lora's router figure: how often a request for a LoRA adapter lands on a replica that
already holds it in a device slot, under kvscale's default routing policy and under round-robin.

Real replicas (``kvscale serve --enable-lora``, every adapter registered, ``--max-loras`` slots,
every adapter in the host pool so a miss costs a layout, not a read) publishing to one Redis, one
router per policy in front (bench.w3_fleet). The stream: adapters drawn with Zipf popularity, each
request a fresh short prompt of random token ids and 1-4 output tokens, sent one at a time (two
CPU cores run the whole fleet). Each policy replays the same stream with its own ``cache_salt``;
the replicas' slots are first filled with adapters the stream never names (sent to each replica
directly), so each policy starts from the same cold slots.

A hit is read from what the replicas report: the router names the replica that served each
request (``x-kvscale-replica``), and a replica's slots are least recently used first out over
the adapters of the requests it ran (server/worker/lora_manager.py), exactly so while requests
run one at a time: ``device_pool_hits`` replays each replica's requests through its slots. After
each run the replay's slots are checked against the slots each replica published in its heartbeat
(``lora_resident``); the JSON records both.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from bench.common import redis_server_binary
from bench.w3_fleet import Processes, router_argv, start_fleet, wait_healthy
from kvscale.processes import free_port

ROUTER_POLICIES = ("default", "round-robin")


def zipf_adapters(adapters: Sequence[str], requests: int, exponent: float, seed: int) -> list[str]:
    """``requests`` adapters drawn independently, the k-th of ``adapters`` with weight 1/k^exponent."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** exponent for rank in range(len(adapters))]
    return rng.choices(list(adapters), weights=weights, k=requests)


def device_pool_hits(served: Sequence[tuple[str, str]], slots: int,
                     initial: Mapping[str, Sequence[str]]) -> tuple[list[bool], dict[str, list[str]]]:
    """For each (replica, adapter) request in order: whether the adapter was in the replica's
    slots when it arrived, the slots being least recently used first out (``initial``: each
    replica's slots before, least recent first). Also each replica's slots after, least recent first."""
    pools = {replica: OrderedDict.fromkeys(names) for replica, names in initial.items()}
    hits = []
    for replica, adapter in served:
        pool = pools.setdefault(replica, OrderedDict())
        hits.append(adapter in pool)
        pool[adapter] = None
        pool.move_to_end(adapter)
        while len(pool) > slots:
            pool.popitem(last=False)
    return hits, {replica: list(pool) for replica, pool in pools.items()}


def _complete(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int, salt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt}
    response = client.post(f"{url}/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    return response


def _resident(redis_url: str, replicas: int) -> dict[str, list[str]]:
    import redis

    from kvscale.kv_index_schema import heartbeat_key

    client = redis.Redis.from_url(redis_url)
    out = {}
    for i in range(replicas):
        raw = client.get(heartbeat_key(f"replica-{i}"))
        out[f"replica-{i}"] = sorted(json.loads(raw).get("lora_resident", [])) if raw else []
    return out


def run_policy(client: httpx.Client, router: str, fleet: Any, stream: list[tuple[str, list[int], int]],
               fill: list[str], slots: int, salt: str) -> dict[str, Any]:
    """Fill every replica's slots with ``fill``, send ``stream`` through ``router`` one request at
    a time, and count its hits."""
    ids = {url: f"replica-{i}" for i, url in enumerate(fleet.replica_urls)}
    for url in fleet.replica_urls:
        for name in fill:
            _complete(client, url, name, [11, 12, 13], 1, f"{salt}-fill")
    served, latency = [], []
    for adapter, prompt, max_tokens in stream:
        started = time.perf_counter()
        response = _complete(client, router, adapter, prompt, max_tokens, salt)
        latency.append(time.perf_counter() - started)
        replica = response.headers.get("x-kvscale-replica", "")
        served.append((ids.get(replica, replica), adapter))
    hits, slots_after = device_pool_hits(served, slots, {replica: fill for replica in ids.values()})
    time.sleep(2.5)  # a heartbeat (every second) carries the slots after the last request
    published = _resident(fleet.redis_url, len(fleet.replica_urls))
    per_replica: dict[str, int] = {}
    for replica, _ in served:
        per_replica[replica] = per_replica.get(replica, 0) + 1
    return {"requests": len(served), "hits": sum(hits), "hit_rate": sum(hits) / len(served),
            "requests_per_replica": per_replica, "latency_s_median": sorted(latency)[len(latency) // 2],
            "slots_after_replayed": {r: sorted(s) for r, s in slots_after.items()},
            "slots_after_published": published,
            "replay_matches_published": all(sorted(slots_after.get(r, [])) == s for r, s in published.items())}


def router_figure(args: argparse.Namespace, paths: Mapping[str, str]) -> dict[str, Any]:
    """Start the fleet and a router per policy, run each policy's streams, stop everything."""
    from kvscale.router.policy import DEFAULT_POLICY

    redis_binary = redis_server_binary()
    names = sorted(paths)
    stream_names, fill = names[:args.router_adapters], names[args.router_adapters:args.router_adapters + args.max_loras]
    if len(fill) < args.max_loras:
        raise SystemExit(f"bench.lora: needs {args.router_adapters + args.max_loras} adapters")
    fleet_args = argparse.Namespace(replicas=args.replicas, block_size=16, num_gpu_blocks_override=64,
                                    max_model_len=256, concurrency=4, threads=1, replica_nice=0)
    serve = ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.rank),
             "--max-cpu-loras", str(len(paths)), "--dtype", args.dtype,
             "--lora-modules", *[f"{name}={paths[name]}" for name in names]]
    procs = Processes()
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in ROUTER_POLICIES}
    try:
        fleet = start_fleet(procs, redis_binary, fleet_args, serve)
        routers: dict[str, str] = {}
        router_procs = []
        for policy in ROUTER_POLICIES:
            port = free_port()
            routers[policy] = f"http://127.0.0.1:{port}"
            router_procs.append(procs.start(f"router-{policy}", router_argv(
                port, fleet, DEFAULT_POLICY if policy == "default" else policy, 16, args.seed, 250.0)))
        wait_healthy(fleet.replica_urls, fleet.replica_procs)
        wait_healthy(list(routers.values()), router_procs, timeout=300)
        time.sleep(2.0)  # heartbeats bind replica ids to URLs in every router
        with httpx.Client(timeout=httpx.Timeout(300)) as client:
            for rep in range(args.router_repeats):
                rng = random.Random(args.seed + rep)
                stream = [(name, [rng.randrange(3, 49152) for _ in range(rng.randint(16, 32))], rng.randint(1, 4))
                          for name in zipf_adapters(stream_names, args.router_requests, args.zipf, args.seed + rep)]
                for policy in ROUTER_POLICIES if rep % 2 == 0 else ROUTER_POLICIES[::-1]:
                    run = run_policy(client, routers[policy], fleet, stream, fill, args.max_loras, f"{policy}-{rep}")
                    print(f"bench.lora: router {policy}, stream {rep}: hit rate {run['hit_rate']:.3f}", flush=True)
                    runs[policy].append(run)
    finally:
        procs.stop_all()
    rates = {policy: sum(r["hits"] for r in rs) / sum(r["requests"] for r in rs) for policy, rs in runs.items()}
    return {"policy_default": DEFAULT_POLICY, "replicas": args.replicas, "adapters": len(stream_names),
            "max_loras": args.max_loras, "zipf_exponent": args.zipf, "requests_per_stream": args.router_requests,
            "streams": args.router_repeats, "hit_rate": rates,
            "default_over_round_robin": rates["default"] / rates["round-robin"] if rates["round-robin"] else None,
            "runs": runs, "logs": procs.logdir}
