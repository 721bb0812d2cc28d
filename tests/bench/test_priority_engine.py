"""bench.priority_engine end to end on a few probes: the bundled model, priority scheduling,
probes alone then beside a flood, the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_it_measures_probes_alone_and_beside_a_flood(tmp_path: Path) -> None:
    out = tmp_path / "priority_engine.json"
    subprocess.run([sys.executable, "-m", "bench.priority_engine", "--probes", "4", "--flood", "8", "--out", str(out)],
                   cwd=REPO, check=True, timeout=600)
    result = json.loads(out.read_text())
    for side in ("alone", "flooded"):
        assert result[side]["probes"] == 4
        assert 0 < result[side]["ttft_p50_ms"] <= result[side]["ttft_p90_ms"]
    assert result["alone"]["low_requests_per_s"] == 0 and result["flooded"]["low_requests_per_s"] > 0
    assert result["p90_ttft_ratio"] == result["flooded"]["ttft_p90_ms"] / result["alone"]["ttft_p90_ms"]
    assert result["machine"]["cpu_count"] and "priority_engine --probes 4" in result["command"]
