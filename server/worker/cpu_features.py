"""What this machine's CPU is, read once from /proc/cpuinfo, for the decisions that depend on it
(which GEMM library runs float32 projections, which dtype ``--dtype auto`` picks on CPU)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CpuFeatures:
    vendor: str  # vendor_id: GenuineIntel, AuthenticAMD, ... ("" where the kernel does not say)
    model_name: str
    flags: frozenset[str] = field(default_factory=frozenset)

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX-512 BF16 or AMX), not emulated through fp32."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def is_intel(self) -> bool:
        return self.vendor == "GenuineIntel"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's vendor, model name and flags (x86 ``flags``, Arm ``Features``)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            if values:
                break  # the blank line after the first processor
            continue
        values.setdefault(key, value.strip())
    flags = values.get("flags") or values.get("Features") or ""
    return CpuFeatures(values.get("vendor_id", ""), values.get("model name", ""), frozenset(flags.split()))


@functools.cache
def cpu_features() -> CpuFeatures:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: nothing known, every decision takes its conservative branch
        return CpuFeatures("", "")
