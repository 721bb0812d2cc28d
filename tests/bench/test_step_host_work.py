"""bench.step_host_work's measuring side, run small against this tree: every phase is timed and
the step's outputs cross the wire."""

from __future__ import annotations

from pathlib import Path

from bench.common import REPO
from bench.step_host_work import measure, tiny_model


def test_a_small_run_times_every_phase(tmp_path: Path) -> None:
    row = measure(REPO, tiny_model(tmp_path), num_seqs=4, context=40, steps=3)
    assert set(row) == {"schedule_ms", "prepare_ms", "outputs_ms", "step_ms", "wire_encode_ms", "wire_decode_ms",
                        "wire_bytes", "host_ms"}
    assert all(value > 0 for value in row.values()), row
    assert row["host_ms"] < row["step_ms"]
