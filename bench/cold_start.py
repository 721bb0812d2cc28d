"""A replica's cold start: from `kvscale serve` (the bundled model) starting to its first ready
``/health``, wall time and the CPU its processes (front end and engine core) spent on the way.
A scale-out or a scale from zero waits this long, on a node that other pods share.

With ``--before-checkout`` each round starts one server from this tree and one from the other,
alternating which goes first (bench.before_after):

    git worktree add --detach /tmp/kv-before HEAD~1
    python -m bench.cold_start --before-checkout /tmp/kv-before --rounds 5

Writes ``bench/results/cold_start.json``: every start, and per side the medians (and before ÷
after where there are two sides).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.before_after import add_before_checkout, checkout_of, commits, median_ratio, order
from bench.common import REPO, checkout_env, machine, write_result
from bench.http_servers import Server, spawn, stop
from bench.roofline import cpu_isa
from kvscale.processes import free_port, wait_until

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(session: int) -> float:
    """User and system CPU of every live process in ``session``."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command's name: state, ppid, pgrp, session, ..., utime (12th), stime (13th).
        if int(fields[3]) == session:
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def healthy(server: Server) -> bool:
    """Whether the server answers /health with 200; RuntimeError once its process has exited."""
    if server.proc.poll() is not None:
        raise RuntimeError(f"{server.name} exited with {server.proc.returncode}: see {server.log_path}")
    try:
        return httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def start_once(checkout: Path, log_dir: Path, name: str, timeout_s: float) -> dict[str, float]:
    port = free_port()
    argv = [sys.executable, "-m", "kvscale", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    server: Server = spawn(name, argv, checkout_env(checkout, HF_HUB_OFFLINE="1"), port, "", log_dir, checkout)
    try:
        wait_until(lambda: healthy(server), timeout_s, interval=0.05, what=f"{name} ready (log: {server.log_path})")
        wall = time.perf_counter() - server.spawned_at
        return {"ready_s": round(wall, 3), "cpu_s": round(session_cpu_seconds(server.proc.pid), 3)}
    finally:
        stop(server)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_before_checkout(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sides = ["before", "after"] if args.before_checkout else ["after"]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvscale-cold-start-") as logs:
        for round_id in range(args.rounds):
            entry = {}
            for side in (s for s in order(round_id) if s in sides):
                checkout = checkout_of(side, args.before_checkout) if args.before_checkout else REPO
                entry[side] = start_once(checkout, Path(logs), f"{side}-{round_id}", args.timeout)
                print(f"round {round_id} {side}: {entry[side]}", file=sys.stderr)
            rounds.append(entry)
    if args.before_checkout:
        summary = {key: median_ratio(rounds, lambda side, key=key: side[key]) for key in ("ready_s", "cpu_s")}
    else:
        summary = {key: {"after": statistics.median(r["after"][key] for r in rounds)} for key in ("ready_s", "cpu_s")}
    result = {
        "command": " ".join(["python -m bench.cold_start", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {**machine(), "isa": cpu_isa()},
        "commits": commits(args.before_checkout),
        "rounds": rounds,
        "summary": summary,
    }
    path = write_result("cold_start", result, args.out)
    print(f"wrote {path}: {summary}", file=sys.stderr)


if __name__ == "__main__":
    main()
