"""The fused mixture-of-experts kernel (kernels/moe_triton.py) against its PyTorch reference, and
server/worker/moe.py's block through it against its own loop, in Triton's interpreter on the CPU.

One child process runs every case of moe_checks.py under the interpreter
(tests/kernels/interpreted.py); each test asserts on its dtype's share.
"""

from __future__ import annotations

import json

import pytest
from interpreted import run_interpreted
from moe_checks import CASES

from kvscale.kernels.moe import block_rows

DTYPES = ["float32", "bfloat16", "float16"]


@pytest.fixture(scope="module")
def interpreted_results() -> list[dict]:
    args = ["--seed", "5", "--block", *[arg for dtype in DTYPES for arg in ("--dtype", dtype)]]
    return run_interpreted("moe_checks.py", args)


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
