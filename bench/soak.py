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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvscale import metric_names as contract
from kvscale.processes import free_port
from kvscale.router.cli_up import Child, Stack

KVSCALE = [sys.executable, "-m", "kvscale"]
PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely. ",
    "The following is a conversation about the history of the Mediterranean sea and its ports. ",
    "Summarise the text below for a busy reader who has only a minute to spare. ",
]
WORDS = "river mountain lantern harbour orchard copper meadow signal winter ledger compass".split()


@dataclass
class Outcome:
    index: int
    started: float
    ended: float = 0.0
    replica: str | None = None
    router_ms: float | None = None
    chunks: int = 0
    done: bool = False  # saw [DONE]
    hung_up: bool = False  # the client left on purpose
    error: str | None = None
    router_retries: int = 0
    first_chunk_s: float | None = None  # time to the first streamed chunk (TTFT as a client sees it)


@dataclass
class Fault:
    name: str
    at: float
    until: float | None = None
    target: str | None = None
    notes: list[str] = field(default_factory=list)


class Platform:
    def __init__(self, replicas: int, blocks: int, kv_offloading_size: float = 0.0) -> None:
        self.stack = Stack()
        self.blocks = blocks
        self.kv_offloading_size = kv_offloading_size
        self.redis_port = free_port()
        self.redis: Child | None = None
        self.replicas: dict[str, Child] = {}
        self.replica_ports: dict[str, int] = {}
        self.routers: dict[str, Child] = {}
        self.router_ports: dict[str, int] = {}
        self.names = [f"r{i}" for i in range(replicas)]
        # The replicas share the machine's cores: more OpenMP threads than cores in all would
        # make every replica wait at each layer for descheduled threads of the others.
        self.threads_per_replica = max(1, len(os.sched_getaffinity(0)) // replicas)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (make system-deps)")
        self.redis = self.stack.spawn("redis", [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                               "--save", "", "--appendonly", "no", "--dir", self.stack.logdir],
                                      self.redis_url, None)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                import socket

                with socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def start_replica(self, name: str) -> Child:
        port = self.replica_ports.setdefault(name, free_port())
        url = f"http://127.0.0.1:{port}"
        child = self.stack.spawn(name, KVSCALE + [
            "serve", "--host", "127.0.0.1", "--port", str(port), "--redis", self.redis_url, "--replica-id", name,
            "--num-gpu-blocks-override", str(self.blocks), "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-offloading-size", str(self.kv_offloading_size),
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"], url, f"{url}/health",
            env_extra={"OMP_NUM_THREADS": str(self.threads_per_replica)})
        self.replicas[name] = child
        return child

    def start_router(self, name: str) -> Child:
        port = self.router_ports.setdefault(name, free_port())
        url = f"http://127.0.0.1:{port}"
        urls = ",".join(f"http://127.0.0.1:{self.replica_ports[n]}" for n in self.names)
        child = self.stack.spawn(name, KVSCALE + [
            "router", "--host", "127.0.0.1", "--port", str(port), "--replicas", urls, "--redis", self.redis_url,
            "--health-interval", "0.5", "--log-level", "warning"], url, f"{url}/metrics")
        self.routers[name] = child
        return child

    def start(self, timeout: float) -> None:
        self.start_redis()
        for name in self.names:
            self.start_replica(name)
        self.stack.wait_healthy(list(self.replicas.values()), timeout)
        for name in ("router-a", "router-b"):
            self.start_router(name)
        self.stack.wait_healthy(list(self.routers.values()), timeout)

    def replica_id_of(self, name: str) -> str:
        return name

    def rss_mib(self, name: str) -> float | None:
        child = self.replicas.get(name) or self.routers.get(name)
        if child is None or not child.alive():
            return None
        for line in Path(f"/proc/{child.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return None


# Transport failures that leave a request unanswered and may be retried on another router.
RETRIED_BEFORE_HEAD = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def _prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.choice([4, 12, 40, 120])))
    return rng.choice(PREFIXES) + words


async def one_request(client: httpx.AsyncClient, routers: list[str], index: int, rng: random.Random,
                      outcomes: list[Outcome]) -> None:
    outcome = Outcome(index, time.monotonic())
    outcomes.append(outcome)
    body = {"prompt": _prompt(rng), "max_tokens": rng.choice([4, 8, 16, 32, 64]), "temperature": 0.8,
            "stream": True, "ignore_eos": True}
    hang_up_after = rng.randint(1, 6) if rng.random() < 1 / 3 else None
    order = routers[index % len(routers):] + routers[: index % len(routers)]
    tries = order * 3  # a Service in front of the routers, retried briefly
    for attempt, router in enumerate(tries):
        head = False  # the router's response status and headers arrived
        try:
            async with client.stream("POST", f"{router}/v1/completions", json=body) as response:
                head = True
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:200]
                    if response.status_code == 503 and attempt + 1 < len(tries):
                        outcome.router_retries += 1
                        await asyncio.sleep(0.2)
                        continue
                    outcome.error = f"HTTP {response.status_code}: {text}"
                    break
                outcome.replica = response.headers.get("x-kvscale-replica")
                ms = response.headers.get("x-kvscale-router-ms")
                outcome.router_ms = float(ms) if ms else None
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        outcome.done = True
                        break
                    outcome.chunks += 1
                    if outcome.first_chunk_s is None:
                        outcome.first_chunk_s = time.monotonic() - outcome.started
                    if '"error"' in line[:20]:
                        outcome.error = line[:200]
                    if hang_up_after is not None and outcome.chunks >= hang_up_after:
                        outcome.hung_up = True
                        break
                break
        except RETRIED_BEFORE_HEAD as exc:
            # A stopping router closes its idle keep-alive connections; one the client picked from
            # its pool at that moment is reset before any answer. Clients retry that (the openai
            # client retries every connection error); a failure after the answer began is a loss.
            if not head and attempt + 1 < len(tries):
                outcome.router_retries += 1
                await asyncio.sleep(0.2)
                continue
            outcome.error = f"{type(exc).__name__}: {exc}"
            break
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            break
    outcome.ended = time.monotonic()


async def load(platform_: Platform, requests: int, concurrency: int, seed: int, outcomes: list[Outcome],
               schedule_done=lambda: True) -> None:
    """``requests`` requests, and more (up to 3x) while the fault schedule is still running."""
    routers = [f"http://127.0.0.1:{platform_.router_ports[n]}" for n in ("router-a", "router-b")]
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=2.0), limits=limits) as client:
        issued = 0

        async def worker(w: int) -> None:
            nonlocal issued
            local = random.Random(seed * 1000 + w)
            while issued < requests or (not schedule_done() and issued < 3 * requests):
                issued += 1
                await one_request(client, routers, issued - 1, local, outcomes)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))


def _wait_exit(child: Child, timeout: float) -> int | None:
    try:
        return child.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def chaos(platform_: Platform, progress, faults: list[Fault], stop: list[bool], timeout: float,
          finished: list[bool]) -> None:
    """The schedule, run in a thread; ``progress()`` is the fraction of requests finished.

    The thread then waits for ``stop``: children get PR_SET_PDEATHSIG, which fires when the
    *thread* that started them ends, so the processes it restarted live only as long as it does.
    """
    try:
        _schedule(platform_, progress, faults, stop, timeout)
    finally:
        finished[0] = True
        while not stop[0]:
            time.sleep(0.1)


def _schedule(platform_: Platform, progress, faults: list[Fault], stop: list[bool], timeout: float) -> None:

    def at(fraction: float) -> bool:
        while progress() < fraction:
            if stop[0]:
                return False
            time.sleep(0.05)
        return True

    names = platform_.names
    if not at(0.15):
        return
    fault = Fault("sigkill_replica", time.monotonic(), target=names[0])
    faults.append(fault)
    platform_.replicas[names[0]].proc.kill()
    platform_.replicas[names[0]].proc.wait()
    platform_.start_replica(names[0])
    platform_.stack.wait_healthy([platform_.replicas[names[0]]], timeout)
    fault.until = time.monotonic()

    if not at(0.35):
        return
    fault = Fault("sigterm_replica", time.monotonic(), target=names[1])
    faults.append(fault)
    child = platform_.replicas[names[1]]
    child.proc.send_signal(signal.SIGTERM)
    code = _wait_exit(child, 60)
    fault.notes.append(f"exit code {code} after {time.monotonic() - fault.at:.1f} s")
    platform_.start_replica(names[1])
    platform_.stack.wait_healthy([platform_.replicas[names[1]]], timeout)
    fault.until = time.monotonic()

    if not at(0.55):
        return
    fault = Fault("redis_restart", time.monotonic(), target="redis")
    faults.append(fault)
    assert platform_.redis is not None
    platform_.redis.proc.kill()
    platform_.redis.proc.wait()
    time.sleep(3.0)
    platform_.start_redis()
    time.sleep(3.0)  # replicas resync, routers reload
    fault.until = time.monotonic()

    if not at(0.75):
        return
    fault = Fault("router_restart", time.monotonic(), target="router-a")
    faults.append(fault)
    child = platform_.routers["router-a"]
    child.proc.send_signal(signal.SIGTERM)
    code = _wait_exit(child, 60)
    fault.notes.append(f"exit code {code} after {time.monotonic() - fault.at:.1f} s")
    platform_.start_router("router-a")
    platform_.stack.wait_healthy([platform_.routers["router-a"]], timeout)
    fault.until = time.monotonic()


def summarize(outcomes: list[Outcome], faults: list[Fault], platform_: Platform, rss_start: dict,
              wall_s: float, args: argparse.Namespace) -> dict:
    by_name = {f.name: f for f in faults}

    def cut_on(fault_name: str) -> list[Outcome]:
        fault = by_name.get(fault_name)
        if fault is None:
            return []
        # The router names a replica by its heartbeat id, or by host:port until it has seen one.
        ids = {fault.target, f"127.0.0.1:{platform_.replica_ports.get(fault.target or '', 0)}"}
        return [o for o in outcomes if o.replica in ids and o.started < fault.at < o.ended
                and not o.done and not o.hung_up]

    failed_before = [o for o in outcomes if o.error and o.chunks == 0]
    other_failed = [o for o in outcomes if not o.done and not o.hung_up and o.chunks > 0
                    and o not in cut_on("sigkill_replica")]
    idle = _idle_metrics(platform_)
    quiet = [o.router_ms for o in outcomes if o.router_ms is not None
             and not any(f.at <= o.started <= (f.until or f.at) for f in faults)]
    windows = {f.name: _quantile(0.99, [o.router_ms for o in outcomes if o.router_ms is not None
                              and f.at <= o.started <= (f.until or f.at)]) for f in faults}
    restarted = {f.target for f in faults}
    rss_end = {n: None if n in restarted else platform_.rss_mib(n) for n in platform_.names}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return {
        "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform()},
        "config": {"requests": args.requests, "concurrency": args.concurrency, "replicas": args.replicas,
                   "routers": 2, "seed": args.seed, "blocks": args.blocks,
                   "kv_offloading_size_gib": args.kv_offloading_size},
        "wall_s": round(wall_s, 1),
        "requests": len(outcomes),
        "completed": sum(o.done for o in outcomes),
        "hung_up_on_purpose": sum(o.hung_up for o in outcomes),
        "failed_before_streaming": len(failed_before),
        "failed_before_streaming_examples": [f"{o.error} ({_when(o, faults)})" for o in failed_before[:5]],
        "cut_by_sigterm": len(cut_on("sigterm_replica")),
        "cut_by_sigterm_examples": [asdict(o) for o in cut_on("sigterm_replica")[:3]],
        "cut_by_sigkill": len(cut_on("sigkill_replica")),
        "other_cut_streams": len(other_failed),
        "other_cut_examples": [asdict(o) for o in other_failed[:3]],
        "client_retries_on_other_router": sum(o.router_retries for o in outcomes),
        "leaked_blocks": _leaked_blocks(idle),
        "leaked_host_blocks": _leaked_host_blocks(idle),
        "host_tier": _host_tier_moves(idle),
        "rss_growth_mib": {n: (round(rss_end[n] - rss_start[n], 1) if rss_end.get(n) and rss_start.get(n)
                               else None) for n in platform_.names},
        "rss_note": "replicas restarted by the schedule (SIGKILL, SIGTERM) have no comparable start",
        "router_ms_p99": {"quiet_baseline": _quantile(0.99, quiet), **windows},
        "faults": [asdict(f) for f in faults],
    }


def _gauge(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


def _when(outcome: Outcome, faults: list[Fault]) -> str:
    """Which fault a request overlapped, to tell a failure's cause from the report alone."""
    overlapped = [f.name for f in faults if outcome.started <= (f.until or f.at) and f.at <= outcome.ended]
    return "during " + ", ".join(overlapped) if overlapped else "no fault under way"


def _idle_metrics(platform_: Platform) -> dict[str, str]:
    """Each replica's /metrics once its KV cache holds no live request (or after 30 s)."""
    texts: dict[str, str] = {}
    for name, child in platform_.replicas.items():
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            try:
                text = httpx.get(f"{child.url}/metrics", timeout=10).text
            except httpx.HTTPError as exc:
                text = f"unreachable: {exc}"
                time.sleep(0.5)
                continue
            if _gauge(text, contract.KV_BLOCKS_ACTIVE.series) == 0:
                break
            time.sleep(0.5)
        texts[name] = text
    return texts


def _leaked_blocks(texts: dict[str, str]) -> dict:
    """Tier 1: blocks still held by live requests once idle."""
    return {name: _gauge(text, contract.KV_BLOCKS_ACTIVE.series) for name, text in texts.items()}


def _leaked_host_blocks(texts: dict[str, str]) -> dict:
    """Tier 2: host slots neither free nor holding a findable block once idle (usage x total
    counts every slot not free; cached, those a prefix lookup can find)."""
    out: dict = {}
    for name, text in texts.items():
        usage = _gauge(text, contract.CPU_CACHE_USAGE.series)
        total = _gauge(text, contract.KV_HOST_BLOCKS_TOTAL.series)
        cached = _gauge(text, contract.KV_HOST_BLOCKS_CACHED.series)
        out[name] = None if None in (usage, total, cached) else round(usage * total - cached, 3)
    return out


def _host_tier_moves(texts: dict[str, str]) -> dict:
    """Blocks demoted and promoted, summed over the replicas (those restarted count from zero)."""
    return {metric.name: sum(_gauge(text, metric.series) or 0.0 for text in texts.values())
            for metric in (contract.KV_BLOCKS_DEMOTED, contract.KV_BLOCKS_PROMOTED, contract.KV_PREEMPTIONS_SWAPPED)}


def _honest(outcomes: list[Outcome]) -> dict:
    ttfts = [o.first_chunk_s for o in outcomes if not o.hung_up and o.first_chunk_s is not None]
    return {"requests": len(outcomes), "failed": sum(1 for o in outcomes if o.error),
            "failed_examples": [o.error for o in outcomes if o.error][:5],
            "ttft_p50_s": _quantile(0.5, ttfts), "ttft_p90_s": _quantile(0.9, ttfts)}


def _quantile(q: float, values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def hostile_main(args: argparse.Namespace) -> int:
    """The honest load alone, then the same load beside hostile clients, on one platform."""
    from hostile_clients import HostileStats, run_hostile

    platform_ = Platform(args.replicas, args.blocks, args.kv_offloading_size)
    try:
        platform_.start(args.startup_timeout)
        routers = [f"http://127.0.0.1:{platform_.router_ports[n]}" for n in ("router-a", "router-b")]
        asyncio.run(load(platform_, 2 * args.replicas, args.replicas, args.seed + 99, []))
        names = [*platform_.names, "router-a", "router-b"]
        rss_start = {n: platform_.rss_mib(n) for n in names}
        alone: list[Outcome] = []
        started = time.monotonic()
        asyncio.run(load(platform_, args.requests, args.concurrency, args.seed, alone))
        alone_s = time.monotonic() - started
        stats = HostileStats()
        beside: list[Outcome] = []

        async def both() -> None:
            stop = asyncio.Event()
            hostile = asyncio.create_task(run_hostile(routers, stats, stop))
            await asyncio.sleep(5)  # the hostile clients under way before the honest load starts
            await load(platform_, args.requests, args.concurrency, args.seed, beside)
            stop.set()
            await asyncio.wait_for(hostile, 360)

        started = time.monotonic()
        asyncio.run(both())
        beside_s = time.monotonic() - started
        honest_alone, honest_beside = _honest(alone), _honest(beside)
        p90_alone, p90_beside = honest_alone["ttft_p90_s"], honest_beside["ttft_p90_s"]
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                      if line.startswith("Model name")), "")
        result = {
            "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(),
                        "load_avg_1m_at_end": os.getloadavg()[0]},
            "config": {"requests": args.requests, "concurrency": args.concurrency,
                       "replicas": args.replicas, "routers": 2, "seed": args.seed},
            "honest_alone": {**honest_alone, "wall_s": round(alone_s, 1)},
            "honest_beside_hostile": {**honest_beside, "wall_s": round(beside_s, 1)},
            "ttft_p90_ratio": round(p90_beside / p90_alone, 2) if p90_alone and p90_beside else None,
            "hostile": stats.as_dict(),
            "leaked_blocks": _leaked_blocks(_idle_metrics(platform_)),
            "rss_growth_mib": {n: (round(end - rss_start[n], 1) if end and rss_start.get(n) else None)
                               for n in names for end in [platform_.rss_mib(n)]},
            "processes_alive": {n: bool((platform_.replicas.get(n) or platform_.routers.get(n)).alive())
                                for n in names},
        }
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
        import threading

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
