"""The same kernel-vs-reference comparisons as the interpreter tests, compiled on CUDA.

Collected only when CUDA is available (see conftest.py); ``python bench/gpu_kernels.py --check``
runs the same checks outside pytest.
"""

from __future__ import annotations

import json

import pytest
import torch
from kernel_checks import KERNELS, run_checks
from triton.runtime.interpreter import InterpretedFunction

from kvscale.kernels.decode_attention import _decode_kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_kernels_are_compiled_not_interpreted() -> None:
    assert not isinstance(_decode_kernel, InterpretedFunction), "TRITON_INTERPRET is set"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_kernel_matches_reference_on_cuda(kernel: str, dtype: torch.dtype) -> None:
    results = run_checks([kernel], [dtype], cases=12, seed=99, device="cuda")
    assert len(results) == 12
    failures = [r for r in results if not r["ok"]]
    assert not failures, json.dumps(failures, indent=1)
