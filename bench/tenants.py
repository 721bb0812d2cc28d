"""Tenants on real parts, each figure with its baseline in the same run (docs/router.md, "Tenants";
docs/performance.md, "Tenants"):

    python -m bench.tenants   # 10-18 min on a loaded 2-vCPU host; the JSON records every parameter
    python -m bench.tenants --figures priority --before-checkout /tmp/kv-before   # one figure, two commits

One Redis, ``--replicas`` `kvscale serve` replicas of the bundled model (``--max-num-seqs`` small,
so a few requests saturate them; ``--scheduling-policy priority``; a key of their own, so they
trust the router's tenant header), two `kvscale router`s with one tenants file, the same Redis,
``--max-queue-wait`` and ``--scheduling-policy priority``, and a third router without tenants.
Clients send through both tenant routers in turn. The figures:

1. **limit**: a tenant with ``requests_per_minute: N`` sends N + extra requests one after the
   other within one window, alternately to the two routers: exact when the first N pass and every
   later one is a 429 with Retry-After and code rate_limit_exceeded. Baseline: a tenant without
   limits sending the same.
2. **light TTFT**: a light tenant's requests one at a time while a heavy one keeps
   ``--load-factor`` x the fleet's batch in flight: mean TTFT with their own keys (fair share)
   ÷ with one shared key (one tenant: first come, first served).
3. **service gap**: two tenants of equal weight, both backlogged, one asking 4x the other's
   completion tokens per request: the largest difference in tokens served over any window, against
   VTC's bound. Tokens count as VTC's service counts them: a prompt's when its first token
   arrives, each generated one as its chunk arrives (streams with ``logprobs: 0``, whose tokens
   the chunk lists). Beside it, the same gap with each request's tokens counted at its end, which
   adds up to the tokens of the requests in flight.
4. **priority**: a high-priority tenant's requests one at a time under a low-priority flood of
   ``--load-factor`` x the batch: TTFT p90 (the first token's) ÷ the same requests alone.
5. **router-added latency**: the x-kvscale-router-ms of one-token requests, alternately through
   a tenant router (a tenant with limits: the admission script runs) and the router without
   tenants: p50 / p99 of each.

Its parts: the clients (bench.tenants_client), the figures (bench.tenants_figures); the fleet
is bench.w3_fleet's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.before_after import add_before_checkout, commits
from bench.common import RESULTS, exit_on_sigterm, redis_server_binary, write_result
from bench.roofline import cpu_info
from bench.soak_breakdown import cpu_seconds, cpu_share, lag_summary, with_loop_lag
from bench.stats import quantile
from bench.tenants_client import (
    CLIENT_ONLY,
    Answer,
    beside_load,
    closed_loop,
    completed_per_s,
    completion,
    fleet_pids,
    http_client,
    one_by_one,
    probe_twins,
    token_service,
    ttft_summary,
)
from bench.tenants_figures import at_most, limit_outcome, ms_summary, ratio, service_gap, vtc_bound
from bench.w3_fleet import Processes, router_argv, start_fleet, wait_healthy
from kvscale.processes import free_port
from kvscale.tenant_limits_schema import WINDOW_S

LOW_PRIORITY = 10  # vLLM's convention: lower is more urgent
FIGURES = ("limit", "light_ttft", "priority", "service_gap", "router_latency")


def tenants_file(rate_limit: int) -> list[dict[str, Any]]:
    """Every tenant of the run, each with a key of its own."""
    entries: list[dict[str, Any]] = [
        {"name": "limited", "requests_per_minute": rate_limit},
        {"name": "open"}, {"name": "light"}, {"name": "heavy"}, {"name": "shared"}, {"name": "a"}, {"name": "b"},
        {"name": "high"}, {"name": "low", "priority": LOW_PRIORITY},
        # Limits it never reaches: the admission script runs on each of its requests (figure 5).
        {"name": "metered", "requests_per_minute": 10**6, "tokens_per_minute": 10**9},
    ]
    return [{**entry, "api_key": f"sk-bench-{entry['name']}-{secrets.token_hex(8)}"} for entry in entries]


def prompt(tenant: str, n: int) -> str:
    return f"Request {n} from {tenant}: write one sentence about the number {n}."


class Run:
    """The fleet's addresses and the tenants' keys, and each figure as a method."""

    def __init__(self, args: argparse.Namespace, routers: list[str], plain_router: str,
                 keys: dict[str, str]) -> None:
        self.args, self.routers, self.plain_router, self.keys = args, routers, plain_router, keys
        self.batch = args.replicas * args.max_num_seqs

    async def limit(self, redis_url: str) -> dict[str, Any]:
        count = self.args.rate_limit + self.args.rate_extra
        answers = {}
        async with http_client(2) as client:
            for tenant in ("open", "limited"):
                if tenant == "limited":
                    await asyncio.to_thread(wait_for_window_start, redis_url, count)
                answers[tenant] = await one_by_one(client, self.routers, self.keys[tenant], tenant,
                                                   lambda n: completion("Hello", 1, False), count)
        outcome = limit_outcome([a.record() for a in answers["limited"]], self.args.rate_limit)
        return {"limit": self.args.rate_limit, "limited": outcome,
                # Requests the routers let in unchecked because Redis did not answer (fail-open).
                "unchecked": sum(metric(url, "kvscale_router_tenant_limits_unchecked_total") for url in self.routers),
                "baseline_without_limits": limit_outcome([a.record() for a in answers["open"]], count),
                "admitted_per_router": [sum(1 for a in answers["limited"] if a.status == 200 and a.router == r)
                                        for r in range(len(self.routers))]}

    def _load(self, client: httpx.AsyncClient, key_of: str, tenant: str,
              in_flight: int) -> Callable[[asyncio.Event], Awaitable[list[Answer]]]:
        """``tenant``'s closed loop of ``in_flight`` requests, sent with ``key_of``'s key."""
        return lambda stop: closed_loop(
            client, self.routers, self.keys[key_of], tenant,
            bodies(tenant, self.args.output_tokens), in_flight, stop)

    def _probes(self, client: httpx.AsyncClient, key_of: str, tenant: str,
                count: int) -> Callable[[], Awaitable[list[Answer]]]:
        """``count`` streamed requests of ``tenant``, one at a time, sent with ``key_of``'s key."""
        return lambda: one_by_one(
            client, self.routers, self.keys[key_of], tenant,
            lambda n: completion(prompt(tenant, n), self.args.output_tokens, True), count, pause_s=0.1)

    async def light_ttft(self) -> dict[str, Any]:
        args, in_flight = self.args, self.args.load_factor * self.batch
        sides: dict[str, Any] = {}
        for side, (light_key, heavy_key) in {"fifo_shared_key": ("shared", "shared"),
                                             "fair_share": ("light", "heavy")}.items():
            async with http_client(in_flight) as client:
                light, heavy = await beside_load(client, self._load(client, heavy_key, "heavy", in_flight),
                                                 self._probes(client, light_key, "light", args.light_requests),
                                                 args.warm_s)
            sides[side] = {**ttft_summary(light), "heavy_requests": len(heavy),
                           "heavy_errors": sum(1 for a in heavy if a.status != 200),
                           "heavy_completed_per_s": completed_per_s(heavy), "loadavg_1m": os.getloadavg()[0]}
        mean = ratio(sides["fair_share"]["ttft_mean_s"], sides["fifo_shared_key"]["ttft_mean_s"])
        return {"heavy_in_flight": in_flight, **sides, "mean_ttft_ratio": mean, "target": 0.3,
                "verdict": at_most(mean, 0.3)}

    async def gap(self) -> dict[str, Any]:
        args, in_flight = self.args, self.args.load_factor * self.batch // 2
        sizes = {"a": 4 * args.output_tokens, "b": args.output_tokens}
        stop = asyncio.Event()
        async with http_client(2 * in_flight) as client:
            loops = [closed_loop(client, self.routers, self.keys[t], t, streamed_bodies(t, sizes[t]), in_flight, stop)
                     for t in ("a", "b")]
            started = time.perf_counter()
            running = asyncio.gather(*loops)
            await asyncio.sleep(args.gap_s)
            stopped = time.perf_counter()
            stop.set()
            answers = [a for side in await running for a in side]
        done = [a for a in answers if a.status == 200]
        window = (started + args.warm_s, stopped)  # both tenants keep requests waiting throughout
        served = [(a.ended_s, a.tenant, a.tokens) for a in done]
        per_token = [event for a in done for event in token_service(a)]
        gap = service_gap(per_token, "a", "b", *window)
        bound = vtc_bound(max(a.prompt_tokens for a in done), max(a.tokens for a in done), self.batch,
                          args.replicas * args.num_gpu_blocks_override * args.block_size)
        in_window = [s for s in served if window[0] <= s[0] <= window[1]]
        return {"in_flight_per_tenant": in_flight, "completion_tokens": sizes, "window_s": window[1] - window[0],
                "tokens_served": {t: sum(s[2] for s in in_window if s[1] == t) for t in sizes},
                "requests_served": {t: sum(1 for s in in_window if s[1] == t) for t in sizes},
                "errors": len(answers) - len(done),
                # Answers whose chunks did not account for their usage's completion tokens.
                "chunks_short": sum(1 for a in done if sum(n for _, n in a.chunks) != a.completion_tokens),
                "service_gap_tokens": gap, "vtc_bound_tokens": bound,
                "service_gap_tokens_at_request_end": service_gap(served, "a", "b", *window),
                "verdict": "met" if gap <= bound else "not met", "loadavg_1m": os.getloadavg()[0],
                # 1 while a router orders tenants by the fleet's counters in Redis, 0 by its own.
                "fair_share_shared": [metric(url, "kvscale_router_fair_share_shared") for url in self.routers],
                "served": [[round(s[0] - started, 4), s[1], s[2]] for s in served]}

    async def priority(self) -> dict[str, Any]:
        args, in_flight = self.args, self.args.load_factor * self.batch
        # Where the probes' TTFT goes besides the replica: the routers' share (x-kvscale-router-ms:
        # tenant admission, the fair queue, the decision), this client's event-loop lag, and the
        # cores each process used while the probes ran (a 2-vCPU host runs them all).
        pids = fleet_pids()
        lags: dict[str, list[float]] = {"alone": [], "under_flood": []}
        cores: dict[str, dict[str, float]] = {}
        phases: dict[str, tuple[float, float]] = {}  # perf_counter span of each side's probes

        def probes(client: httpx.AsyncClient, side: str) -> Callable[[], Awaitable[list[Answer]]]:
            # Each prompt twice in turn: as is, then with skip_special_tokens false. The model's
            # first token for most of these prompts is <|im_end|>, whose text is dropped by
            # default, so their first chunk carries the second token; the second kind's carries the
            # first. The figure is the second kind's, the time to the first token on both sides;
            # the first kind's (the first chunk with text) is reported beside it.
            async def measured() -> list[Answer]:
                before, began = cpu_seconds(pids, CLIENT_ONLY), time.perf_counter()
                twins = probe_twins(lambda n: prompt("high", n), args.output_tokens)
                answers = await with_loop_lag(one_by_one(client, self.routers, self.keys["high"], "high", twins,
                                                         2 * args.priority_requests, pause_s=0.1), lags[side])
                cores[side] = cpu_share(before, cpu_seconds(pids, CLIENT_ONLY), time.perf_counter() - began)
                phases[side] = (began, time.perf_counter())
                return answers
            return measured

        async with http_client(in_flight) as client:
            alone_both = await probes(client, "alone")()
            flooded_both, low = await beside_load(client, self._load(client, "low", "low", in_flight),
                                                  probes(client, "under_flood"), args.warm_s)
        alone, flooded = alone_both[1::2], flooded_both[1::2]
        p90 = ratio(ttft_summary(flooded)["ttft_p90_s"], ttft_summary(alone)["ttft_p90_s"])
        text = {"alone": ttft_summary(alone_both[::2]), "under_flood": ttft_summary(flooded_both[::2])}
        text["p90_ttft_ratio"] = ratio(text["under_flood"]["ttft_p90_s"], text["alone"]["ttft_p90_s"])
        breakdown = {side: {"router_ms": ms_summary([a.router_ms for a in answers if a.router_ms is not None]),
                            "client_loop_lag": lag_summary(lags[side]), "cores_used": cores[side]}
                     for side, answers in (("alone", alone_both), ("under_flood", flooded_both))}
        return {"low_in_flight": in_flight, "alone": ttft_summary(alone), "under_flood": ttft_summary(flooded),
                "low_requests": len(low), "low_errors": sum(1 for a in low if a.status != 200),
                # The flood's throughput while the probes ran (a commit that serves the probes
                # faster ends the phase sooner: the count alone does not compare).
                "low_requests_per_s": sum(1 for a in low if phases["under_flood"][0] <= a.ended_s <= phases["under_flood"][1])
                / (phases["under_flood"][1] - phases["under_flood"][0]),
                "p90_ttft_ratio": p90, "target": 1.5, "verdict": at_most(p90, 1.5),
                "first_token": "skip_special_tokens false", "first_text_chunk": text, "breakdown": breakdown, "loadavg_1m": os.getloadavg()[0]}

    async def router_latency(self) -> dict[str, Any]:
        sides: dict[str, list[float]] = {"tenants": [], "no_tenants": []}
        body = completion("The capital of France is", 1, False)
        async with http_client(2) as client:
            for n in range(self.args.latency_rounds + 10):  # the first 10: warm-up, not counted
                order = [("tenants", self.routers[0], "metered"), ("no_tenants", self.plain_router, None)]
                for side, url, tenant in order[n % 2:] + order[:n % 2]:
                    answer = (await one_by_one(client, [url], self.keys[tenant] if tenant else None,
                                               tenant or "none", lambda _: body, 1))[0]
                    if answer.status != 200 or answer.router_ms is None:
                        raise RuntimeError(f"router latency: {side} answered {answer.status}")
                    if n >= 10:
                        sides[side].append(answer.router_ms)
        # p99 of a few hundred requests is their few largest: those are kept to tell one spike from a tail.
        out: dict[str, Any] = {s: {"p50_ms": quantile(v, 0.5), "p90_ms": quantile(v, 0.9), "p99_ms": quantile(v, 0.99),
                                   "max_ms": max(v), "largest_ms": sorted(v, reverse=True)[:8]}
                               for s, v in sides.items()}
        p99 = out["tenants"]["p99_ms"]
        return {"rounds": self.args.latency_rounds, **out, "target_p99_ms": 2.0, "verdict": at_most(p99, 2.0),
                "loadavg_1m": os.getloadavg()[0]}


def bodies(tenant: str, max_tokens: int) -> Callable[[int], dict[str, Any]]:
    """``tenant``'s n-th request, non-streamed."""
    return lambda n: completion(prompt(tenant, n), max_tokens, False)


def streamed_bodies(tenant: str, max_tokens: int) -> Callable[[int], dict[str, Any]]:
    """``tenant``'s n-th request, streamed with its usage and each chunk's tokens listed."""
    return lambda n: {**completion(prompt(tenant, n), max_tokens, True), "logprobs": 0}


def metric(url: str, name: str) -> float:
    """A router's metric ``name``, summed over its series."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


def load_note(start: float, end: float, cpus: int | None) -> str:
    """The machine's load during the run, as measured: the 1-min load average at its start and
    at its latest figure's end, beside the CPUs that share it."""
    return f"1-min load average {start:.2f} at the start, {end:.2f} at the end, on {cpus} CPUs"


def wait_for_window_start(redis_url: str, requests: int) -> None:
    """Sleep into the next rate-limit window unless this one (Redis's clock) has room for
    ``requests`` sent one after the other (half a second each, generously)."""
    import redis

    seconds, micros = redis.Redis.from_url(redis_url).time()
    left = WINDOW_S - (seconds % WINDOW_S) - micros / 1e6
    if left < requests / 2 + 5:
        time.sleep(left + 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each replica's batch slots")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=128, help="KV blocks per replica")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="each replica's step token "
                        "budget (kvscale serve's flag, vLLM's spelling; its default when not given)")
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--load-factor", type=int, default=10, help="the heavy / low tenant's requests in "
                        "flight, in multiples of the fleet's batch (replicas x max-num-seqs)")
    parser.add_argument("--warm-s", type=float, default=3.0, help="load before the measured requests start")
    parser.add_argument("--rate-limit", type=int, default=20, help="the limited tenant's requests_per_minute")
    parser.add_argument("--rate-extra", type=int, default=5, help="requests sent past the limit")
    parser.add_argument("--light-requests", type=int, default=8)
    parser.add_argument("--priority-requests", type=int, default=12)
    parser.add_argument("--gap-s", type=float, default=30.0, help="how long both tenants stay backlogged")
    parser.add_argument("--latency-rounds", type=int, default=100)
    parser.add_argument("--max-queue-wait", type=float, default=120.0)
    parser.add_argument("--out", default=str(RESULTS / "tenants.json"))
    parser.add_argument("--figures", default=",".join(FIGURES),
                        help=f"the figures to measure, comma-separated, in this order: {','.join(FIGURES)}")
    add_before_checkout(parser, help="also measure the figures with replicas and routers running the code of this "
                        "tree (a git worktree of an earlier commit): each figure twice, 'before' then this "
                        "tree's, each side on a fleet of its own")
    args = parser.parse_args(argv)
    names = [name for name in args.figures.split(",") if name]
    if unknown := sorted(set(names) - set(FIGURES)):
        parser.error(f"unknown figures {unknown}: choose from {', '.join(FIGURES)}")
    redis_binary = redis_server_binary()
    exit_on_sigterm()
    machine = cpu_info()
    started = time.time()
    tenants = tenants_file(args.rate_limit)
    figures: dict[str, Any] = {}
    result: dict[str, Any] = {
        "benchmark": "tenants",
        "command": "python -m bench.tenants " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        # What bench.common.machine() measured (the 1-min load at the start), the load at the end
        # added as each figure is written: what the run was, never what it was meant to be.
        "machine": machine,
        "parameters": {**vars(args), "before_checkout": str(args.before_checkout) if args.before_checkout else None},
        "commits": commits(args.before_checkout),
        "figures": figures,
    }

    def record(key: str, value: dict[str, Any]) -> None:
        figures[key] = value
        print(key, {k: v for k, v in value.items() if k != "served"}, flush=True)
        # Written after each figure: a run cut short keeps the figures it finished.
        result.update(elapsed_s=time.time() - started, loadavg_1m_at_end=round(os.getloadavg()[0], 2))
        machine["note"] = load_note(machine["loadavg_1m_at_start"], result["loadavg_1m_at_end"],
                                    machine["cpu_count"])
        write_result("tenants", result, args.out)

    if args.before_checkout is not None:
        measure(args, redis_binary, tenants, names, args.before_checkout,
                lambda name, value: record(f"{name}_before", value))
    measure(args, redis_binary, tenants, names, None, record)
    if args.before_checkout is not None and "priority" in names:
        sides = [figures[key]["p90_ttft_ratio"] for key in ("priority_before", "priority")]
        figures["priority_p90_ratio_before_and_after"] = sides
    print(f"tenants: wrote {write_result('tenants', result, args.out)}")
    return 0


def measure(args: argparse.Namespace, redis_binary: str, tenants: list[dict[str, Any]], names: list[str],
            checkout: Path | None, record: Callable[[str, dict[str, Any]], None]) -> None:
    """The fleet (its replicas and routers running ``checkout``'s code, this tree's by default), then
    each of ``names``' figures on it, passed to ``record``; the fleet is stopped at the end."""
    procs = Processes()
    cwd = str(checkout) if checkout else None
    tenants_path = Path(procs.logdir) / "tenants.yaml"
    tenants_path.write_text(yaml.safe_dump(tenants))
    replica_key = secrets.token_hex(16)  # the replicas believe the tenant header only from its holder
    fleet_args = argparse.Namespace(replicas=args.replicas, block_size=args.block_size,
                                    num_gpu_blocks_override=args.num_gpu_blocks_override, max_model_len=256,
                                    concurrency=args.max_num_seqs, threads=args.threads, replica_nice=0)
    try:
        budget = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []
        fleet = start_fleet(procs, redis_binary, fleet_args,
                            ["--api-key", replica_key, "--scheduling-policy", "priority", *budget], checkout)
        ports = [free_port() for _ in range(3)]
        env = {"KVSCALE_REPLICA_API_KEY": replica_key}
        router_procs = [procs.start(f"router-{i}", router_argv(port, fleet, "predicted-ttft", args.block_size, 0,
                                                               250.0)
                                    + ["--tenants", str(tenants_path), "--max-queue-wait", str(args.max_queue_wait),
                                       "--scheduling-policy", "priority"], env=env, cwd=cwd)
                        for i, port in enumerate(ports[:2])]
        router_procs.append(procs.start("router-plain", router_argv(ports[2], fleet, "predicted-ttft",
                                                                    args.block_size, 0, 250.0), env=env, cwd=cwd))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        print(f"tenants: starting the fleet (logs in {procs.logdir})", flush=True)
        wait_healthy(fleet.replica_urls, fleet.replica_procs)
        wait_healthy(urls, router_procs, timeout=300)
        time.sleep(2.0)  # the replicas' heartbeats reach the routers: their room is known
        run = Run(args, urls[:2], urls[2], {t["name"]: t["api_key"] for t in tenants})
        every: dict[str, Callable[[], Coroutine[Any, Any, dict[str, Any]]]] = {
            "limit": lambda: run.limit(fleet.redis_url), "light_ttft": run.light_ttft,
            "priority": run.priority, "service_gap": run.gap, "router_latency": run.router_latency}
        for name in (name for name in FIGURES if name in names):
            load = os.getloadavg()[0]
            began = time.perf_counter()
            record(name, {**asyncio.run(every[name]()), "loadavg_1m_before": load,
                          "wall_s": time.perf_counter() - began})
    finally:
        procs.stop_all()

if __name__ == "__main__":
    raise SystemExit(main())
