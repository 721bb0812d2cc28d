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
    # One output token: a low-priority request ends in its prefill step, so each step the flood
    # takes either serves some or is given up to a probe.
    subprocess.run([sys.executable, "-m", "bench.priority_engine", "--probes", "4", "--flood", "8",
                    "--output-tokens", "1", "--out", str(out)], cwd=REPO, check=True, timeout=600)
    result = json.loads(out.read_text())
    for side in ("alone", "flooded"):
        assert result[side]["probes"] == 4
        assert 0 < result[side]["ttft_p50_ms"] <= result[side]["ttft_p90_ms"]
    # The flood competed with the probes: on a quiet machine its requests are served between them;
    # on a loaded one (four CPU hogs here) none ends in the flooded side's second, but the
    # engine gives its steps up to the probes.
    alone, flooded = result["alone"], result["flooded"]
    assert alone["low_requests_per_s"] == 0 and alone["steps_given_up"] == 0
    assert flooded["low_requests_per_s"] > 0 or flooded["steps_given_up"] > 0, flooded
    assert result["p90_ttft_ratio"] == result["flooded"]["ttft_p90_ms"] / result["alone"]["ttft_p90_ms"]
    assert result["machine"]["cpu_count"] and "priority_engine --probes 4" in result["command"]
