"""The router benchmarks' fleet on one machine: Redis, N `kvscale serve` replicas publishing to it
and routers in front, as child processes with logs of their own; their health, their prefix-cache
counters and their heartbeats (bench.w3_router, bench.w3_fleet_ceiling)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvscale.processes import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


def _child_setup(nice: int) -> None:
    die_with_parent()  # a killed benchmark leaves no replicas behind
    if nice:
        os.nice(nice)


class Processes:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = tempfile.mkdtemp(prefix="kvscale-w3-")

    def start(self, name: str, argv: list[str], nice: int = 0, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        log = open(os.path.join(self.logdir, f"{name}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd or str(REPO),
            preexec_fn=lambda: _child_setup(nice),
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


def replica_counters(urls: list[str]) -> list[dict[str, float]]:
    """Each replica's prefix-cache queries and hits (tokens) and finished requests."""
    out = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        counts = {"queries": 0.0, "hits": 0.0, "requests": 0.0}
        for line in text.splitlines():
            match = re.match(r"^vllm:(prefix_cache_queries|prefix_cache_hits|request_success)_total(\{[^}]*\})?\s+(\S+)$",
                             line)
            if match:
                key = {"prefix_cache_queries": "queries", "prefix_cache_hits": "hits",
                       "request_success": "requests"}[match.group(1)]
                counts[key] += float(match.group(3))
        out.append(counts)
    return out


def cache_counters(replica_urls: list[str]) -> tuple[float, float]:
    """Prefix-cache queries and hits (tokens), summed over the replicas."""
    counts = replica_counters(replica_urls)
    return sum(c["queries"] for c in counts), sum(c["hits"] for c in counts)


@dataclass
class Fleet:
    redis_url: str
    replica_urls: list[str]
    replica_procs: list[subprocess.Popen]


def start_fleet(procs: Processes, redis_binary: str, args: argparse.Namespace,
                extra_serve_args: list[str] | None = None, checkout: Path | None = None) -> Fleet:
    """Redis, then ``args.replicas`` replicas publishing to it (ids replica-0, replica-1, ...), each
    with ``args``' KV pool, model length, ``args.concurrency`` sequences at most, torch threads and
    niceness; not waited for (``wait_healthy``). ``checkout``: the tree whose code the replicas
    run (another commit's worktree: bench.before_after), this one by default."""
    redis_port = free_port()
    procs.start("redis", [redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", procs.logdir])
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    replica_urls, replica_procs = [], []
    for i in range(args.replicas):
        port = free_port()
        replica_urls.append(f"http://127.0.0.1:{port}")
        replica_procs.append(procs.start(
            f"replica-{i}",
            [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--block-size", str(args.block_size), "--num-gpu-blocks-override", str(args.num_gpu_blocks_override),
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.concurrency),
             "--redis", redis_url, "--replica-id", f"replica-{i}", "--disable-uvicorn-access-log"]
            + list(extra_serve_args or []),
            nice=args.replica_nice, env={"OMP_NUM_THREADS": str(args.threads)},
            cwd=str(checkout) if checkout else None,
        ))
    return Fleet(redis_url, replica_urls, replica_procs)


def router_argv(port: int, fleet: Fleet, policy: str, block_size: int, seed: int, redis_timeout_ms: float,
                log_level: str = "warning") -> list[str]:
    """`kvscale router` with ``policy`` in front of the fleet's replicas, reading its Redis (at
    ``log_level`` "debug" it logs a record of every decision: bench.w3_router --decision-log)."""
    return [sys.executable, "-m", "kvscale", "router", "--host", "127.0.0.1", "--port", str(port),
            "--replicas", ",".join(fleet.replica_urls), "--redis", fleet.redis_url, "--policy", policy,
            "--block-size", str(block_size), "--seed", str(seed), "--log-level", log_level,
            "--redis-timeout-ms", str(redis_timeout_ms)]


def decision_records(log_path: str) -> list[dict]:
    """The decision records of a router run at log level debug (kvscale.router.decision)."""
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            marker = line.find("kvscale.router.decision: decision ")
            if marker >= 0:
                out.append(json.loads(line[marker + len("kvscale.router.decision: decision "):]))
    return out


class HeartbeatSampler:
    """Reads every replica's heartbeat from Redis twice a second, for the simulator's calibration."""

    FIELDS = ("prefill_tokens_per_s", "decode_step_s", "step_token_budget", "num_decoding",
              "prefill_tokens_waiting")

    def __init__(self, redis_url: str) -> None:
        import redis

        from kvscale.kv_index_schema import heartbeat_key

        self._client = redis.Redis.from_url(redis_url)
        self._key = heartbeat_key
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for i in range(64):
                raw = self._client.get(self._key(f"replica-{i}"))
                if raw is None:
                    if i >= 8:
                        break
                    continue
                beat = json.loads(raw)
                self.samples.append({"t": time.time(), "replica": beat["replica"],
                                     **{k: beat.get(k, 0) for k in self.FIELDS}})

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, windows: list[tuple[float, float]]) -> dict:
        window = [s for s in self.samples if any(a <= s["t"] <= b for a, b in windows)]
        out = {}
        for key in ("prefill_tokens_per_s", "decode_step_s", "step_token_budget"):
            values = [s[key] for s in window if s[key] > 0]
            out[f"{key}_median"] = statistics.median(values) if values else 0.0
        return out
