"""Chaos soak: the whole local platform under load while a schedule breaks it.

Starts what `kvscale up` starts (Redis, N replicas publishing to it) plus two routers, and sends
``--requests`` streamed completions of mixed lengths through the routers from ``--concurrency``
clients; a third of them hang up mid-stream on purpose. Meanwhile, at fixed fractions of the
run: a replica is SIGKILLed (and started again), another gets SIGTERM like a rolling update
(drains, exits, is started again), Redis is killed and restarted, and a router gets SIGTERM and
is started again. The clients stand for a Service in front of the two routers: a connection
refused or a router's draining 503 before any byte is retried on the other router.

Reported (JSON, ``--out``):
- ``failed_before_streaming``: requests that failed without a byte of answer (target 0);
- ``cut_by_sigterm``: streams on the SIGTERMed replica that did not finish (target 0);
- ``cut_by_sigkill``: streams on the SIGKILLed replica that did not finish (expected: a kill);
- ``leaked_blocks``: ``kvscale:kv_blocks_active`` on every replica once idle (target 0);
- ``leaked_host_blocks``: with ``--kv-offloading-size``, host-tier slots neither free nor holding
  a findable block on every replica once idle (target 0), beside the blocks demoted and promoted;
- ``rss_growth_mib``: replicas' resident memory from after warm-up to the end (replicas that ran
  throughout);
- ``router_ms_p99``: the routers' added latency (``x-kvscale-router-ms``) per fault window, and
  for the quiet part of the run as the baseline measured in the same run.

    .venv/bin/python bench/soak.py --requests 2000 --out bench/results/soak.json

Its parts: the platform (bench.soak_platform), the clients (bench.soak_client), the fault schedule
(bench.soak_faults) and the report (bench.soak_report).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file (`python bench/soak.py`, as above and in tests/router): its siblings import as bench.*.
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.soak_breakdown import (  # noqa: E402
    OWN_ONLY,
    cpu_seconds,
    cpu_share,
    lag_summary,
    platform_pids,
    ttft_by_bomb,
    ttft_by_spans,
    with_loop_lag,
)
from bench.soak_client import Outcome, load  # noqa: E402
from bench.soak_faults import Fault, chaos  # noqa: E402
from bench.soak_platform import ROUTERS, Platform  # noqa: E402
from bench.soak_report import (  # noqa: E402
    honest,
    hostile_targets_met,
    idle_metrics,
    leaked_blocks,
    machine_info,
    summarize,
)
from kvscale.request_limits import DEFAULT_MAX_SEQUENCES_PER_REQUEST  # noqa: E402

HOSTILE_GRACE_S = 10
# The replicas' --request-timeout is the bombs' deadline less this: time for the 504 to travel
# back through the router on a loaded machine.
BOMB_DEADLINE_MARGIN_S = 30


def hostile_main(args: argparse.Namespace) -> int:
    """The honest load alone, then the same load beside hostile clients, on one platform."""
    from bench.hostile_clients import pacing
    from bench.hostile_process import HostileProcess, HostileSettings

    # The routers check a key, so that the unauthenticated clients meet the check; honest and
    # hostile tenants alike send it. The replicas' compile limit sits under what the slow schemas
    # take (bench/hostile_payloads.py), so each of them is refused, not served late. Their
    # --request-timeout sits under the bombs' deadline, so a bomb the machine cannot serve in
    # time still ends within it, with a 504.
    api_key = "sk-soak-" + secrets.token_urlsafe(12)
    compile_limits = json.dumps({"compile_timeout_s": args.compile_timeout_s})
    request_timeout = max(1.0, args.bomb_deadline_s - BOMB_DEADLINE_MARGIN_S)
    platform_ = Platform(args.replicas, args.blocks, args.kv_offloading_size, api_key=api_key,
                         replica_args=("--structured-outputs-config", compile_limits,
                                       "--request-timeout", f"{request_timeout:g}"))
    try:
        platform_.start(args.startup_timeout)
        routers = platform_.router_urls()
        asyncio.run(load(platform_, 2 * args.replicas, args.replicas, args.seed + 99, []))
        names = [*platform_.names, *ROUTERS]
        rss_start = {n: platform_.rss_mib(n) for n in names}
        alone: list[Outcome] = []
        pids = platform_pids({**platform_.replicas, **platform_.routers,
                              **({"redis": platform_.redis} if platform_.redis else {})})
        lags: dict[str, list[float]] = {"alone": [], "beside_hostile": []}
        cpu_before = cpu_seconds(pids, own_only=OWN_ONLY)
        started = time.monotonic()
        asyncio.run(with_loop_lag(load(platform_, args.requests, args.concurrency, args.seed, alone), lags["alone"]))
        alone_s = time.monotonic() - started
        cpu_alone = cpu_share(cpu_before, cpu_seconds(pids, own_only=OWN_ONLY), alone_s)
        beside: list[Outcome] = []

        print(f"honest load alone: {len(alone)} requests in {alone_s:.0f} s", file=sys.stderr, flush=True)

        async def progress() -> None:
            # A long run shows where it is (the hostile process reports its own counts).
            while True:
                await asyncio.sleep(15)
                print(f"beside hostile: {sum(1 for o in beside if o.ended)}/{args.requests} honest ended",
                      file=sys.stderr, flush=True)

        async def honest_beside_hostile() -> None:
            reporter = asyncio.create_task(progress())
            try:
                await with_loop_lag(load(platform_, args.requests, args.concurrency, args.seed, beside),
                                    lags["beside_hostile"])
            finally:
                reporter.cancel()

        # The hostile clients run in a process of their own (bench/hostile_process.py), as real
        # attackers on other machines would: the honest clients' loop does not wait on theirs.
        # When the honest load is done, what they still have open ends within a grace (a bomb in
        # flight: within its deadline, so that every bomb sent has an outcome to judge) or is
        # given up, as a client leaving would, and not counted: waiting for each slow-loris upload
        # would add a minute to every run. The replicas must free what was given up before the
        # leak check.
        hostile = HostileProcess(HostileSettings(routers, api_key, args.bomb_sequences,
                                                 args.bomb_deadline_s, HOSTILE_GRACE_S))
        pids["hostile_clients"] = hostile.start()
        started = time.monotonic()
        try:
            time.sleep(5)  # the hostile clients under way before the honest load starts
            cpu_at_start = cpu_seconds(pids, own_only=OWN_ONLY)
            honest_started = time.monotonic()
            asyncio.run(honest_beside_hostile())
        except BaseException:
            hostile.kill()
            raise
        # Over the honest requests' own span: the bombs' tail after it is not what they met.
        cpu_beside = cpu_share(cpu_at_start, cpu_seconds(pids, own_only=OWN_ONLY),
                               time.monotonic() - honest_started)
        stats = hostile.stop_and_collect()
        beside_s = time.monotonic() - started
        honest_alone, honest_beside = honest(alone), honest(beside)
        p90_alone, p90_beside = honest_alone["ttft_p90_s"], honest_beside["ttft_p90_s"]
        result = {
            "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {**machine_info(), "load_avg_1m_at_end": os.getloadavg()[0]},
            "config": {"requests": args.requests, "concurrency": args.concurrency,
                       "replicas": args.replicas, "routers": 2, "seed": args.seed,
                       "routers_api_key": True, "bomb_sequences": args.bomb_sequences,
                       "bomb_deadline_s": args.bomb_deadline_s, "replicas_request_timeout_s": request_timeout,
                       "compile_timeout_s": args.compile_timeout_s,
                       "hostile_clients": {"process": "own (bench/hostile_process.py)", **pacing()}},
            "honest_alone": {**honest_alone, "wall_s": round(alone_s, 1)},
            "honest_beside_hostile": {**honest_beside, "wall_s": round(beside_s, 1)},
            "ttft_p90_ratio": round(p90_beside / p90_alone, 2) if p90_alone and p90_beside else None,
            "hostile": stats.as_dict(),
            # Where the honest TTFT goes (bench/soak_breakdown.py): cores each process used while
            # the honest load ran, the soak client's event-loop lag, TTFT with and without a bomb.
            "breakdown": {"cores_used": {"alone": cpu_alone, "beside_hostile": cpu_beside},
                          "client_loop_lag": {side: lag_summary(v) for side, v in lags.items()},
                          "honest_ttft_by_bomb": ttft_by_bomb(beside, stats.bomb_spans),
                          "honest_ttft_by_slow_schema": ttft_by_spans(beside, stats.slow_schema_spans,
                                                                      "slow_schema")},
            "leaked_blocks": leaked_blocks(idle_metrics(platform_)),
            "rss_growth_mib": {n: (round(end - rss_start[n], 1) if end and rss_start.get(n) else None)
                               for n in names for end in [platform_.rss_mib(n)]},
            "processes_alive": {n: bool((platform_.replicas.get(n) or platform_.routers.get(n)).alive())
                                for n in names},
        }
        result["targets_met"] = hostile_targets_met(result)
    finally:
        platform_.stack.stop(grace_s=20)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks per replica")
    parser.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                        help="replicas' host KV tier (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--out", default="bench/results/soak.json")
    parser.add_argument("--hostile", action="store_true",
                        help="no fault schedule: the honest load alone, then beside hostile clients "
                             "(bench/hostile_clients.py), in the same run")
    parser.add_argument("--bomb-sequences", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                        help="--hostile: prompts in each request-wide bomb (default: the replicas' "
                             "--max-sequences-per-request)")
    parser.add_argument("--bomb-deadline-s", type=float, default=300.0,
                        help="--hostile: each bomb must end within this, answered with every choice "
                             "or refused 400/503/504; the replicas' --request-timeout is 30 s less "
                             "(default 300)")
    parser.add_argument("--compile-timeout-s", type=float, default=0.1,
                        help="--hostile: the replicas' grammar compile limit (CPU seconds), well "
                             "under what the slow schemas take: ~1.5 s on the host they were sized "
                             "on, but 0.5 s let one through on a host ~4x faster (default 0.1)")
    args = parser.parse_args()
    if args.hostile:
        return hostile_main(args)
    if args.replicas < 2:
        raise SystemExit("--replicas must be at least 2 (one is SIGKILLed, another SIGTERMed)")

    platform_ = Platform(args.replicas, args.blocks, args.kv_offloading_size)
    outcomes: list[Outcome] = []
    faults: list[Fault] = []
    stop = [False]
    try:
        platform_.start(args.startup_timeout)
        # Warm-up, then the memory baseline.
        asyncio.run(load(platform_, 2 * args.replicas, args.replicas, args.seed + 99, []))
        rss_start = {n: platform_.rss_mib(n) for n in platform_.names}
        started = time.monotonic()
        finished = [False]
        thread = threading.Thread(
            target=chaos, args=(platform_, lambda: sum(1 for o in outcomes if o.ended) / args.requests,
                                faults, stop, args.startup_timeout, finished), daemon=True)
        thread.start()
        asyncio.run(load(platform_, args.requests, args.concurrency, args.seed, outcomes,
                         schedule_done=lambda: finished[0]))
        wall_s = time.monotonic() - started
        # Let a restart in progress finish (the thread keeps its children alive until stop).
        deadline = time.monotonic() + args.startup_timeout
        while not finished[0] and time.monotonic() < deadline:
            time.sleep(0.2)
        result = summarize(outcomes, faults, platform_, rss_start, wall_s, args)
    finally:
        stop[0] = True
        platform_.stack.stop(grace_s=20)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("faults", "other_cut_examples", "cut_by_sigterm_examples")}, indent=2))
    print(f"logs: {platform_.stack.logdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
