"""The compiled-kernel tests exist only where there is a GPU to compile for.

On a machine without CUDA ``test_kernels_gpu.py`` is not collected at all (rather than
collected and skipped), so a CPU-only run never reports a GPU check as if it had happened.
The CPU run covers the same comparisons through Triton's interpreter.
"""

import sys
from pathlib import Path

import pytest
import torch

# kernel_checks.py (the comparisons, shared with bench/gpu_kernels.py) is imported by module name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

collect_ignore = [] if torch.cuda.is_available() else ["test_kernels_gpu.py"]


@pytest.fixture
def fresh_cpu_library(monkeypatch: pytest.MonkeyPatch):
    """Each test picks the C kernels up again from its own environment."""
    from kvscale.kernels import cpu_build, cpu_native, lora_cpu

    def clear() -> None:
        cpu_build.library.cache_clear()
        cpu_native.amx_prefill_available.cache_clear()
        cpu_native.f32_prefill_available.cache_clear()
        cpu_native.narrow_linear_available.cache_clear()
        cpu_native.amx_linear_available.cache_clear()
        cpu_native.dot_linear_available.cache_clear()
        lora_cpu.native_available.cache_clear()

    monkeypatch.delenv("KVSCALE_CPU_KERNELS", raising=False)
    clear()
    yield
    clear()
