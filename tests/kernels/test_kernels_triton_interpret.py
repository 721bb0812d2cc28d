"""Each Triton kernel against its PyTorch reference, run by Triton's interpreter on the CPU.

The kernels run in a child process with ``TRITON_INTERPRET=1``: Triton decides between compiling
and interpreting when a kernel is decorated, so setting the variable inside the pytest process
would also turn every other test's kernels (the engine's, on a GPU machine) into interpreted
ones. One child runs all cases; each test below asserts on its kernel's and dtype's share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = ["write_kv", "decode", "decode_split", "prefill", "add_rms_norm", "rope", "silu_and_mul", "lora"]
DTYPES = ["float32", "bfloat16", "float16"]
CASES = 4


@pytest.fixture(scope="module")
def interpreted_results() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", KVSCALE_FORCE_TRITON="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, str(Path(__file__).with_name("kernel_checks.py")), "--device", "cpu",
               "--cases", str(CASES), "--seed", "1234"]
    for kernel in KERNELS:
        command += ["--kernel", kernel]
    for dtype in DTYPES:
        command += ["--dtype", dtype]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # A failing comparison exits 1 and is reported per test below; anything else is a crash.
    assert proc.returncode in (0, 1) and results, (
        f"checks exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_kernel_matches_reference_interpreted(
    interpreted_results: list[dict], kernel: str, dtype: str
) -> None:
    mine = [r for r in interpreted_results if r["kernel"] == kernel and r["dtype"] == dtype]
    assert len(mine) == CASES
    failures = [r for r in mine if not r["max_error"] <= r["tolerance"]]
    assert not failures, json.dumps(failures, indent=1)
    if kernel == "add_rms_norm":
        assert {r["residual"] for r in mine} == {True, False}
    elif kernel in ("rope", "silu_and_mul"):
        assert any(r["rows"] > 1 for r in mine)
    elif kernel == "lora":  # base rows among adapters' rows, ranks 8 and 16, a slot over tiles
        assert any(r["base_rows"] for r in mine) and all(r["tiles"] > r["slots_present"] for r in mine)
        assert {8, 16} <= {rank for r in mine for rank in r["ranks"]} and all(r["rows"] % 2 for r in mine)
    elif kernel != "write_kv":
        # The random cases must actually cover what the kernels are for.
        assert any(len(r["context_lens"]) > 1 for r in mine)
        assert any(r["num_heads"] > r["num_kv_heads"] for r in mine)
        assert any(n % r["block_size"] for r in mine for n in r["context_lens"])
    else:
        assert any(r["skipped_slots"] for r in mine)
