"""Reading the CPU's vendor and ISA flags from /proc/cpuinfo (server/worker/cpu_features.py)."""

from __future__ import annotations

from kvscale.server.worker.cpu_features import cpu_features, parse_cpuinfo

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R45
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: not the first processor
flags\t\t: amx_bf16
"""

GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd bf16 sve
CPU implementer\t: 0x41
"""


def test_first_processor_vendor_model_and_flags() -> None:
    cpu = parse_cpuinfo(EPYC)
    assert (cpu.vendor, cpu.model_name) == ("AuthenticAMD", "AMD EPYC 9R45")
    assert {"avx2", "avx512f", "avx512_bf16"} <= cpu.flags and "amx_bf16" not in cpu.flags
    assert cpu.native_bf16 and not cpu.is_intel


def test_arm_features_and_no_x86_bf16() -> None:
    cpu = parse_cpuinfo(GRAVITON)
    assert cpu.vendor == "" and "asimd" in cpu.flags
    assert not cpu.native_bf16  # Arm's bf16 is not the x86 flags oneDNN's bf16 kernels use here
    assert not cpu.is_intel


def test_avx2_only_has_no_native_bf16() -> None:
    assert not parse_cpuinfo("vendor_id\t: AuthenticAMD\nflags\t: avx avx2 fma\n").native_bf16


def test_this_machine_is_read() -> None:
    cpu = cpu_features()
    assert cpu.flags, "no ISA flags read from /proc/cpuinfo"
