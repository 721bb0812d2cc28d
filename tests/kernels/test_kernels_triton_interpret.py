"""Each Triton kernel against its PyTorch reference, run by Triton's interpreter on the CPU.

One child process runs all cases under the interpreter (tests/kernels/interpreted.py says why a
child); each test below asserts on its kernel's and dtype's share.
"""

from __future__ import annotations

import json

import pytest
from interpreted import run_interpreted

KERNELS = ["write_kv", "decode", "decode_split", "prefill", "add_rms_norm", "rope", "silu_and_mul", "lora"]
DTYPES = ["float32", "bfloat16", "float16"]
CASES = 4


@pytest.fixture(scope="module")
def interpreted_results() -> list[dict]:
    args = ["--cases", str(CASES), "--seed", "1234"]
    args += [arg for kernel in KERNELS for arg in ("--kernel", kernel)]
    args += [arg for dtype in DTYPES for arg in ("--dtype", dtype)]
    return run_interpreted("kernel_checks.py", args)


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
