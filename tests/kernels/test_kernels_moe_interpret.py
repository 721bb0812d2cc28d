"""The fused mixture-of-experts kernel (kernels/moe_triton.py) against its PyTorch reference, and
server/worker/moe.py's block through it against its own loop, in Triton's interpreter on the CPU.

As in test_kernels_triton_interpret.py, the checks run in a child process with
``TRITON_INTERPRET=1`` (Triton decides between compiling and interpreting when a kernel is
decorated); one child runs every case of moe_checks.py, each test asserts on its dtype's share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from moe_checks import CASES

from kvscale.kernels.moe import block_rows

DTYPES = ["float32", "bfloat16", "float16"]


@pytest.fixture(scope="module")
def interpreted_results() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", KVSCALE_FORCE_TRITON="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, str(Path(__file__).with_name("moe_checks.py")), "--device", "cpu", "--seed", "5",
               "--block", *[arg for dtype in DTYPES for arg in ("--dtype", dtype)]]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # A failing comparison exits 1 and is reported per test below; anything else is a crash.
    assert proc.returncode in (0, 1) and results, (
        f"checks exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return results


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_kernel_matches_reference_interpreted(interpreted_results: list[dict], dtype: str) -> None:
    mine = [r for r in interpreted_results if r["kernel"] == "moe" and r["dtype"] == dtype]
    assert len(mine) == len(CASES)
    failures = [r for r in mine if not r["max_error"] <= r["tolerance"]]
    assert not failures, json.dumps(failures, indent=1)
    # The cases cover what the plan must get right.
    assert {r["top_k"] for r in mine} == {1, 2, 4} and len({r["experts"] for r in mine}) >= 4
    assert any(0 in r["rows_by_expert"] for r in mine), "an expert no token chose"
    assert any(r["top_k"] == r["experts"] for r in mine)
    assert any(max(r["rows_by_expert"]) > block_rows(r["tokens"] * r["top_k"], r["experts"]) for r in mine), \
        "an expert's rows over several blocks"
    assert any(r["hidden"] > 64 and r["inter"] > 64 for r in mine), "widths over one tile"
    assert {r["round_weights"] for r in mine} == {True, False}


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_runs_the_kernel_where_triton_runs(interpreted_results: list[dict], dtype: str) -> None:
    mine = [r for r in interpreted_results if r["kernel"] == "moe_block" and r["dtype"] == dtype]
    assert [r["top_k"] for r in mine] == [1, 2]
    assert all(r["kernel_calls"] == 1 for r in mine), mine
    failures = [r for r in mine if not r["max_error"] <= r["tolerance"]]
    assert not failures, json.dumps(failures, indent=1)
