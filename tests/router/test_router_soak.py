"""The chaos soak's short version: bench/soak.py, small, with its targets asserted.

Real processes throughout: Redis, three `kvscale serve` replicas, two routers; a replica is
SIGKILLed, another SIGTERMed, Redis and a router are restarted while clients stream. The
replicas' small KV caches spill to a host KV tier, whose slots must not leak either.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_short_soak_meets_its_targets(tmp_path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--requests", "60", "--concurrency", "6",
         "--replicas", "3", "--blocks", "48", "--kv-offloading-size", "0.02", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert [f["name"] for f in result["faults"]] == [
        "sigkill_replica", "sigterm_replica", "redis_restart", "router_restart"]
    assert all(f["until"] for f in result["faults"]), result["faults"]
    assert result["failed_before_streaming"] == 0, result["failed_before_streaming_examples"]
    assert result["cut_by_sigterm"] == 0, result["cut_by_sigterm_examples"]
    assert result["other_cut_streams"] == 0, result["other_cut_examples"]
    assert result["leaked_blocks"] == {"r0": 0.0, "r1": 0.0, "r2": 0.0}
    # 48 KV blocks a replica evict to the host tier, and prefixes come back from it: no slot of
    # either tier is lost through the kills, drains and restarts.
    assert result["leaked_host_blocks"] == {"r0": 0.0, "r1": 0.0, "r2": 0.0}
    assert result["host_tier"]["kvscale:kv_blocks_demoted"] > 0, result["host_tier"]
    assert result["completed"] + result["hung_up_on_purpose"] + result["cut_by_sigkill"] == result["requests"]
