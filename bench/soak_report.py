"""The chaos soak's report: requests failed or cut per fault, KV blocks leaked on either tier
once idle, memory growth, and the routers' added latency per fault window (bench/soak.py's
docstring lists the targets)."""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict

import httpx

from bench.soak_client import Outcome
from bench.soak_faults import Fault
from bench.soak_platform import Platform
from bench.stats import nearest_rank
from kvscale import metric_names as contract


def machine_info() -> dict:
    """The CPU's model name, the cores and the platform the soak ran on."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform()}


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
    idle = idle_metrics(platform_)
    quiet = [o.router_ms for o in outcomes if o.router_ms is not None
             and not any(f.at <= o.started <= (f.until or f.at) for f in faults)]
    windows = {f.name: nearest_rank([o.router_ms for o in outcomes if o.router_ms is not None
                                     and f.at <= o.started <= (f.until or f.at)], 0.99) for f in faults}
    restarted = {f.target for f in faults}
    rss_end = {n: None if n in restarted else platform_.rss_mib(n) for n in platform_.names}
    return {
        "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
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
        "leaked_blocks": leaked_blocks(idle),
        "leaked_host_blocks": leaked_host_blocks(idle),
        "host_tier": host_tier_moves(idle),
        "rss_growth_mib": {n: (round(rss_end[n] - rss_start[n], 1) if rss_end.get(n) and rss_start.get(n)
                               else None) for n in platform_.names},
        "rss_note": "replicas restarted by the schedule (SIGKILL, SIGTERM) have no comparable start",
        "router_ms_p99": {"quiet_baseline": nearest_rank(quiet, 0.99), **windows},
        "faults": [asdict(f) for f in faults],
    }


def _gauge(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


def _when(outcome: Outcome, faults: list[Fault]) -> str:
    """Which fault a request overlapped, to tell a failure's cause from the report alone."""
    overlapped = [f.name for f in faults if outcome.started <= (f.until or f.at) and f.at <= outcome.ended]
    return "during " + ", ".join(overlapped) if overlapped else "no fault under way"


def idle_metrics(platform_: Platform) -> dict[str, str]:
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


def leaked_blocks(texts: dict[str, str]) -> dict:
    """Tier 1: blocks still held by live requests once idle."""
    return {name: _gauge(text, contract.KV_BLOCKS_ACTIVE.series) for name, text in texts.items()}


def leaked_host_blocks(texts: dict[str, str]) -> dict:
    """Tier 2: host slots neither free nor holding a findable block once idle (usage x total
    counts every slot not free; cached, those a prefix lookup can find)."""
    out: dict = {}
    for name, text in texts.items():
        usage = _gauge(text, contract.CPU_CACHE_USAGE.series)
        total = _gauge(text, contract.KV_HOST_BLOCKS_TOTAL.series)
        cached = _gauge(text, contract.KV_HOST_BLOCKS_CACHED.series)
        out[name] = None if None in (usage, total, cached) else round(usage * total - cached, 3)
    return out


def host_tier_moves(texts: dict[str, str]) -> dict:
    """Blocks demoted and promoted, summed over the replicas (those restarted count from zero)."""
    return {metric.name: sum(_gauge(text, metric.series) or 0.0 for text in texts.values())
            for metric in (contract.KV_BLOCKS_DEMOTED, contract.KV_BLOCKS_PROMOTED, contract.KV_PREEMPTIONS_SWAPPED)}


def honest(outcomes: list[Outcome]) -> dict:
    ttfts = [o.first_chunk_s for o in outcomes if not o.hung_up and o.first_chunk_s is not None]
    return {"requests": len(outcomes), "failed": sum(1 for o in outcomes if o.error),
            "failed_examples": [o.error for o in outcomes if o.error][:5],
            "ttft_p50_s": nearest_rank(ttfts, 0.5), "ttft_p90_s": nearest_rank(ttfts, 0.9)}


# What each hostile kind may be answered (status 0: closed without an answer).
HOSTILE_EXPECTED = {"unauthenticated": {401}, "slow_schema": {400, 503}}
TTFT_P90_RATIO_TARGET = 1.5


def bombs_bounded(bombs: list[dict]) -> bool | None:
    """Every bomb ended within its deadline, answered with every choice or refused as documented
    (hostile_payloads.bomb_outcome); None when none ended (those given up at the soak's end are
    not judged)."""
    if not bombs:
        return None
    return all(b["within_deadline"] and b["outcome"] in ("answered", "refused") for b in bombs)


def hostile_targets_met(result: dict) -> dict[str, bool | None]:
    """`bench/soak.py --hostile`'s targets, from its report; None where the run measured nothing."""
    hostile = result["hostile"]
    statuses: dict[str, dict] = hostile["statuses"]
    ratio = result["ttft_p90_ratio"]

    def only(kind: str, allowed: set[int]) -> bool | None:
        answered = {int(status) for status in statuses.get(kind, {})}
        return answered <= allowed if answered else None

    over = hostile["over_limit"]
    unauth_bytes = hostile["unauthenticated_body_bytes_sent_max"]
    return {
        "honest_failed_0": result["honest_alone"]["failed"] == 0 and result["honest_beside_hostile"]["failed"] == 0,
        "ttft_p90_ratio_at_most_1_5": None if ratio is None else ratio <= TTFT_P90_RATIO_TARGET,
        "leaked_blocks_0": all(v == 0 for v in result["leaked_blocks"].values()),
        "processes_alive": all(result["processes_alive"].values()),
        "hostile_clients_ran_throughout": not hostile["loop_errors"],
        "bombs_end_within_deadline": bombs_bounded(hostile.get("bombs", [])),
        **{f"{kind}_answers": only(kind, allowed) for kind, allowed in HOSTILE_EXPECTED.items()},
        "unauthenticated_refused_before_body": None if unauth_bytes is None else unauth_bytes == 0,
        "over_limit_400_naming_the_limit": (all(
            figures["refused_400"] == figures["named_the_limit"] == hostile["sent"][kind]
            for kind, figures in over.items()) if all(hostile["sent"][kind] for kind in over) else None),
    }
