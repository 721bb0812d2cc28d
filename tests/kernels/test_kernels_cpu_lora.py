"""The batched LoRA contract in C (cpu_lora.c through kernels/lora_cpu.py) against the PyTorch
reference (kernels/lora.py's ``torch_add_lora``) and the contract row by row: mixed slots and base
rows, ranks differing per slot, fused slices, an adapter leaving a projection (or a slice) alone,
rows read from a wider tensor; the same source built for an AVX2-only CPU; where it runs.

Tolerance: lora_checks.LORA_TOLERANCE, relative to 1 + |expected| (float32 1e-5: the same float32
products summed in another order; bfloat16 3e-2: h and the delta rounded where PyTorch rounds
them, so against the reference only the sums' order differs)."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
from importlib import resources

import pytest
import torch
from lora_checks import (
    FUSED_SLICES,
    LORA_TOLERANCE,
    LoRACase,
    check_a_slice_its_adapter_leaves_alone,
    make_lora_case,
)

from kvscale.kernels import cpu_build, cpu_prototypes, lora_cpu
from kvscale.kernels.lora import LoRASlots, add_lora, lora_rows, torch_add_lora

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")

FUSED = FUSED_SLICES  # the bundled model's fused projections, scaled down (q wider than k and v)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((actual.double() - expected.double()).abs() / (1 + expected.double().abs())).max())


def _untouched(case: LoRACase) -> list[int]:
    return [i for i, s in enumerate(case.row_slots) if s < 0 or case.pairs[s] is None]


def _case(dtype: torch.dtype, fused: str, rows: int, seed: int = 0) -> LoRACase:
    # Four slots: ranks 8 and 16 (the kernel reads each at its own), one leaving the projection
    # alone; base rows mixed in; slot 0 over more than a tile of rows (kernels/lora.py's TILE_ROWS).
    gen = torch.Generator().manual_seed(seed)
    return make_lora_case(gen, dtype, rows=rows, in_features=75, slice_width=0 if FUSED[fused] else 130,
                          slices=0 if FUSED[fused] else 1, ranks=[8, 16, None, 8], base_share=0.3,
                          first_slots=(-1, 2, 1, 3, *[0] * 18), fused=FUSED[fused])


def test_the_kernel_runs_here() -> None:
    # The test machine has a C compiler (tools/system-deps.sh installs one).
    assert lora_cpu.native_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fused", list(FUSED))
@pytest.mark.parametrize("rows", [23, 61])
def test_each_row_gets_its_own_slots_delta_as_the_reference(dtype: torch.dtype, fused: str, rows: int) -> None:
    case = _case(dtype, fused, rows, seed=rows)
    x, expected, plan, slots = case.on("cpu")
    torch_add_lora(expected, x, plan, slots)
    _, actual, _, _ = case.on("cpu")
    lora_cpu.native_add_lora(actual, x, plan, slots)
    assert _relative_error(actual, expected) < LORA_TOLERANCE[dtype]
    assert _relative_error(actual, case.per_row()) < LORA_TOLERANCE[dtype]
    # Base rows and the rows of slot 2 (no matrices here) bit for bit.
    untouched = _untouched(case)
    assert untouched and torch.equal(actual[untouched], case.out[untouched])
    # One table per slot set, B's zero blocks not held: each slot's B^T its rank by the outputs.
    assert slots.native is not None
    assert slots.native.table[:, 2].tolist() == [8, 16, 0, 8]
    assert [t.numel() for t in slots.native.held[1::2]] == [r * actual.shape[1] for r in (8, 16, 8)]


def test_bfloat16_rounds_where_pytorch_does() -> None:
    # h, the delta and the sum rounded as PyTorch's matmuls round them: only the float32 sums'
    # order differs, so nearly every element equals the reference's.
    case = _case(torch.bfloat16, "qkv", 61, seed=7)
    x, expected, plan, slots = case.on("cpu")
    torch_add_lora(expected, x, plan, slots)
    _, actual, _, _ = case.on("cpu")
    lora_cpu.native_add_lora(actual, x, plan, slots)
    assert (actual != expected).double().mean().item() < 0.01


def test_a_slice_its_adapter_leaves_alone_is_left_alone() -> None:
    check_a_slice_its_adapter_leaves_alone(lora_cpu.native_add_lora)


def test_rows_read_from_a_wider_tensor_and_one_slot_on_every_row() -> None:
    gen = torch.Generator().manual_seed(5)
    case = make_lora_case(gen, torch.float32, rows=18, in_features=48, slice_width=0, slices=0, ranks=[16],
                          base_share=0.0, one_slot=True, fused=FUSED["gate_up"])
    wide = torch.randn(18, 48 + 20, generator=gen)
    wide[:, 5:53] = case.x
    x = wide[:, 5:53]  # a row stride of 68
    _, actual, plan, slots = case.on("cpu")
    lora_cpu.native_add_lora(actual, x, plan, slots)
    assert float((actual.double() - case.per_row()).abs().max()) < 1e-5


def test_a_step_without_adapter_rows_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(6)
    case = make_lora_case(gen, torch.float32, rows=5, in_features=48, slice_width=24, slices=1, ranks=[8],
                          base_share=1.0)
    x, actual, plan, slots = case.on("cpu")
    lora_cpu.native_add_lora(actual, x, plan, slots)
    assert torch.equal(actual, case.out)


def test_the_kernel_runs_where_it_pays() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    # Decode steps, and float32 prefills up to ROWS_MAX rows, of one slot or several.
    for rows in (1, 16, 256):
        for present in (1, 8):
            assert lora_cpu.native_pays(rows, present, f32, True, True)
            assert lora_cpu.native_pays(rows, present, bf16, True, True)
    assert lora_cpu.native_pays(4096, 1, f32, True, True) and lora_cpu.native_pays(4096, 8, f32, True, True)
    assert not lora_cpu.native_pays(4097, 8, f32, True, True)
    # bfloat16: one slot's long prefill is oneDNN's (its bf16 GEMM), several slots' stay here.
    assert lora_cpu.native_pays(512, 1, bf16, True, True)
    assert not lora_cpu.native_pays(513, 1, bf16, True, True)
    assert lora_cpu.native_pays(2048, 2, bf16, True, True)
    # Nowhere else: another dtype, another device, no build, no rows.
    assert not lora_cpu.native_pays(16, 8, torch.float16, True, True)
    assert not lora_cpu.native_pays(16, 8, f32, False, True)
    assert not lora_cpu.native_pays(16, 8, f32, True, False)
    assert not lora_cpu.native_pays(0, 0, f32, True, True)


def test_add_lora_takes_the_kernel_for_a_decode_step() -> None:
    case = _case(torch.float32, "gate_up", 23)
    x, out, plan, slots = case.on("cpu")
    add_lora(out, x, plan, slots)
    assert slots.native is not None and slots.dense is None  # no stacked copy besides the table
    assert _relative_error(out, case.per_row()) < LORA_TOLERANCE[torch.float32]


def test_a_long_bfloat16_step_of_one_slot_keeps_its_pair() -> None:
    gen = torch.Generator().manual_seed(8)
    case = make_lora_case(gen, torch.bfloat16, rows=lora_cpu.ONE_SLOT_ROWS_MAX[torch.bfloat16] + 1, in_features=48,
                          slice_width=24, slices=1, ranks=[8, 8], base_share=0.0, one_slot=True)
    x, out, plan, slots = case.on("cpu")
    add_lora(out, x, plan, slots)
    assert slots.native is None
    assert _relative_error(out, case.per_row()) < LORA_TOLERANCE[torch.bfloat16]


def test_without_the_c_kernels_add_lora_keeps_pytorchs_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", "reference")
    case = _case(torch.float32, "gate_up", 23)
    x, out, plan, slots = case.on("cpu")
    add_lora(out, x, plan, slots)
    assert slots.native is None
    assert _relative_error(out, case.per_row()) < LORA_TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """cpu_lora.c built for an AVX2 CPU without AVX-512 (``-march=x86-64-v3`` after the build's
    own flags), as CI's machines run it."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert compiler is not None
    directory = tmp_path_factory.mktemp("lora-avx2")
    source = directory / "cpu_lora.c"
    source.write_bytes(resources.files("kvscale.kernels").joinpath("cpu_lora.c").read_bytes())
    cpu_build._run_compiler([compiler, *cpu_build.CFLAGS, "-march=x86-64-v3", "-c", "-o", str(directory / "lora.o"),
                             str(source)])
    built = directory / "lora.so"
    cpu_build._run_compiler([compiler, *cpu_build.LDFLAGS, "-o", str(built), str(directory / "lora.o"),
                             *cpu_build.LDLIBS])
    lib = ctypes.CDLL(str(built))
    restype, argtypes = cpu_prototypes.C_PROTOTYPES["kvscale_lora_sgmv"]
    lib.kvscale_lora_sgmv.restype = restype
    lib.kvscale_lora_sgmv.argtypes = argtypes
    return lib


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 build flag")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_avx2_build_matches_the_reference(avx2_build: ctypes.CDLL, dtype: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora_cpu, "library", lambda: avx2_build)
    case = _case(dtype, "qkv", 61, seed=11)
    x, expected, plan, slots = case.on("cpu")
    torch_add_lora(expected, x, plan, slots)
    _, actual, _, _ = case.on("cpu")
    lora_cpu.native_add_lora(actual, x, plan, slots)
    assert _relative_error(actual, expected) < LORA_TOLERANCE[dtype]
    assert torch.equal(actual[_untouched(case)], case.out[_untouched(case)])


def test_a_slot_set_gets_its_table_once() -> None:
    case = _case(torch.float32, "plain", 23)
    x, out, plan, slots = case.on("cpu")
    lora_cpu.native_add_lora(out, x, plan, slots)
    table = slots.native
    lora_cpu.native_add_lora(out[:3], x[:3], lora_rows([3, 0, -1], torch.device("cpu")), slots)
    assert slots.native is table
    # The same matrices in another dtype (another model's slots) get their own.
    other = LoRASlots(tuple(None if p is None else (p[0].bfloat16(), p[1].bfloat16()) for p in slots.pairs))
    lora_cpu.native_add_lora(out.bfloat16(), x.bfloat16(), plan, other)
    assert other.native is not None and other.native.dtype == torch.bfloat16
