"""The batched LoRA contract (kernels/lora.py): a step's rows planned by slot, the PyTorch path
against the contract's per-row definition, the stacked path over every slot
(kernels/lora_dense.py, one expand per fused slice) against that reference and the per-row one,
and which path runs where. The Triton kernel
against the reference: test_kernels_triton_interpret.py (and test_kernels_gpu.py on a GPU)."""

from __future__ import annotations

import pytest
import torch
from lora_checks import (
    FUSED_SLICES,
    LORA_TOLERANCE,
    check_a_slice_its_adapter_leaves_alone,
    make_lora_case,
)

from kvscale.kernels.lora import (
    LoRASlots,
    add_lora,
    lora_path,
    lora_rows,
    plan_rows,
    torch_add_lora,
)
from kvscale.kernels.lora_dense import (
    CALL_MACS,
    dense_add_lora,
    per_slot_macs,
    stacked_macs,
    stacked_pays,
)


def test_rows_are_grouped_by_slot_and_cut_into_tiles_of_one_slot() -> None:
    plan = plan_rows([1, -1, 0, 1, 1, -1, 0, 1, 1], tile_rows=2)
    assert plan.sorted_rows.tolist() == [2, 6, 0, 3, 4, 7, 8]  # base rows in none, row order kept
    assert plan.segments == [(0, 0, 2), (1, 2, 7)]
    assert plan.tiles.tolist() == [[0, 0, 2], [1, 2, 2], [1, 4, 2], [1, 6, 1]]
    assert not plan.every_row


def test_one_slot_on_every_row_needs_no_row_indices() -> None:
    assert plan_rows([3, 3, 3]).every_row
    assert not plan_rows([3, -1, 3]).every_row
    rows = lora_rows([3, 3, 3], torch.device("cpu"))
    assert rows.groups == ((3, None),)
    empty = plan_rows([-1, -1])
    assert empty.segments == [] and empty.tiles.shape == (0, 3)


@pytest.mark.parametrize("row_slots", [[2, -1, 0, 2, 0, 0, -1], [1, 1, 1]])
def test_torch_path_adds_each_rows_own_adapter_delta(row_slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    x, out = torch.randn(len(row_slots), 12, generator=gen), torch.randn(len(row_slots), 10, generator=gen)
    pairs = [(torch.randn(r, 12, generator=gen), torch.randn(10, r, generator=gen)) for r in (4, 8, 16)]
    slots = LoRASlots((pairs[0], None, pairs[2]) if -1 in row_slots else tuple(pairs))
    expected = out.double().clone()
    for i, s in enumerate(row_slots):  # the contract, row by row
        pair = slots.pairs[s] if s >= 0 else None
        if pair is not None:
            expected[i] += pair[1].double() @ (pair[0].double() @ x[i].double())
    torch_add_lora(out, x, lora_rows(row_slots, torch.device("cpu")), slots)
    assert float((out.double() - expected).abs().max()) < 1e-5


def test_triton_on_cuda_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_FORCE_TRITON", raising=False)
    assert lora_path(torch.device("cpu")) == "torch"
    assert lora_path(torch.device("cuda", 0)) == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_over_every_slot_matches_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    # Ranks 8 and 16 (the narrower padded), a slot leaving the projection alone, base rows mixed in.
    case = make_lora_case(gen, dtype, rows=19, in_features=48, slice_width=40, slices=3,
                          ranks=[8, 16, None, 8], base_share=0.3, first_slots=(-1, 2, 0, 1, 3))
    x, expected, rows, slots = case.on("cpu")
    torch_add_lora(expected, x, rows, slots)
    _, actual, _, _ = case.on("cpu")
    dense_add_lora(actual, x, rows, slots)
    error = float(((actual.double() - expected.double()).abs() / (1 + expected.double().abs())).max())
    assert error < LORA_TOLERANCE[dtype], error
    untouched = [i for i, s in enumerate(case.row_slots) if s < 0 or case.pairs[s] is None]
    assert torch.equal(actual[untouched], case.out[untouched])  # base rows, and slot 2's, bit for bit


# The bundled model's fused projections, scaled down: q|k|v (q wider than k and v) and gate|up.
FUSED = {name: sizes for name, sizes in FUSED_SLICES.items() if sizes}  # the fused ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", list(FUSED))
def test_the_expand_per_slice_matches_each_rows_own_adapter(dtype: torch.dtype, fused: str) -> None:
    gen = torch.Generator().manual_seed(3)
    # Four adapters mixed in one batch with base rows: ranks 8 and 16 (the narrower padded), one
    # leaving the projection alone; every slot on the first rows.
    case = make_lora_case(gen, dtype, rows=21, in_features=48, slice_width=0, slices=0, ranks=[8, 16, None, 8],
                          base_share=0.3, first_slots=(-1, 2, 0, 1, 3), fused=FUSED[fused])
    x, actual, rows, slots = case.on("cpu")
    dense_add_lora(actual, x, rows, slots)
    assert slots.dense is not None and len(slots.dense.b_slices) == len(FUSED[fused])
    assert sum(b.shape[1] for _, _, b in slots.dense.b_slices) == actual.shape[1]  # no zero block held
    expected = case.per_row()
    error = float(((actual.double() - expected).abs() / (1 + expected.abs())).max())
    assert error < LORA_TOLERANCE[dtype], error
    untouched = [i for i, s in enumerate(case.row_slots) if s < 0 or case.pairs[s] is None]
    assert torch.equal(actual[untouched], case.out[untouched])  # base rows, and slot 2's, bit for bit


def test_a_slice_its_adapter_leaves_alone_is_left_alone() -> None:
    check_a_slice_its_adapter_leaves_alone(dense_add_lora)


def test_another_slots_overflow_does_not_reach_a_row() -> None:
    # Row 0's product with slot 1's A overflows float32: masked, not multiplied by 0 (inf * 0 = nan).
    big = 2.0**100
    x = torch.tensor([[big, 1.0], [1.0, 1.0]])
    pairs = ((torch.tensor([[1 / big, 0.0]]), torch.ones(2, 1)), (torch.tensor([[big, 0.0]]), torch.ones(2, 1)))
    out = torch.zeros(2, 2)
    dense_add_lora(out, x, lora_rows([0, 1], torch.device("cpu")), LoRASlots(pairs))
    assert out[0].tolist() == [1.0, 1.0] and out[1].tolist() == [big, big]


def test_another_slots_overflow_does_not_reach_a_row_of_a_fused_projection() -> None:
    # The same through two slices: slot 1's A overflows on row 0 in both; row 2 is a base row.
    big = 2.0**100
    x = torch.tensor([[big, 1.0], [1.0, 1.0], [big, big]])
    a0, a1 = torch.tensor([[1 / big, 0.0], [0.0, 1.0]]), torch.tensor([[big, 0.0], [0.0, big]])
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # slice 0: column 0; slice 1: columns 1, 2
    out = torch.zeros(3, 3)
    dense_add_lora(out, x, lora_rows([0, 1, -1], torch.device("cpu")), LoRASlots(((a0, b), (a1, b)), ((0, 1), (1, 2))))
    assert out[0].tolist() == [1.0, 1.0, 1.0]
    assert out[1].tolist() == [big, big, big] and out[2].tolist() == [0.0, 0.0, 0.0]


def test_the_path_doing_fewer_multiply_adds_and_calls_is_chosen() -> None:
    # The bundled model's gate|up (576 -> 2 x 1536), 8 slots of rank 8 held.
    stacked_16 = stacked_macs(16, 576, [1536, 1536], num_slots=8, width=8)
    assert stacked_16 == 16 * 8 * 8 * (2 * 576 + 3072)  # the shrink, then each slice's own columns only
    assert per_slot_macs([2] * 8, [16] * 8, 576, 3072) == 16 * 16 * (576 + 3072)  # B's zero blocks included
    # 16 rows, two of each slot: 4 calls in place of 32 pay for the stacked path's extra multiply-adds.
    assert stacked_pays(stacked_16, 4, per_slot_macs([2] * 8, [16] * 8, 576, 3072), 32)
    # The 16 rows all of one slot: the per-slot pair does an eighth of the multiply-adds.
    assert not stacked_pays(stacked_16, 4, per_slot_macs([16], [16], 576, 3072), 4)
    # A prefill of 2,048 rows over the 8 slots: the multiply-adds decide.
    assert not stacked_pays(stacked_macs(2048, 576, [1536, 1536], 8, 8), 4,
                            per_slot_macs([256] * 8, [16] * 8, 576, 3072), 32)
    # The weighing itself: a call is CALL_MACS multiply-adds.
    assert stacked_pays(CALL_MACS * 10, 2, CALL_MACS * 8, 4)
    assert not stacked_pays(CALL_MACS * 10 + 1, 2, CALL_MACS * 8, 4)


@pytest.mark.usefixtures("fresh_cpu_library")
def test_add_lora_takes_the_stacked_path_for_few_rows_of_several_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the C kernels do not run (their own path: test_kernels_cpu_lora.py).
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", "reference")
    gen = torch.Generator().manual_seed(2)
    case = make_lora_case(gen, torch.float32, rows=16, in_features=48, slice_width=0, slices=0,
                          ranks=[8, 8, 8], base_share=0.0, first_slots=(0, 1, 2), fused=FUSED["gate_up"])
    x, out, rows, slots = case.on("cpu")
    add_lora(out, x, rows, slots)
    assert slots.dense is not None  # the stacked path ran, and kept its stacking
    assert float((out.double() - case.per_row()).abs().max()) < 1e-5
    one = make_lora_case(gen, torch.float32, rows=16, in_features=48, slice_width=0, slices=0, ranks=[8, 8, 8],
                         base_share=0.5, first_slots=(0, -1) * 8, fused=FUSED["gate_up"])
    x, out, rows, slots = one.on("cpu")
    add_lora(out, x, rows, slots)
    assert slots.dense is None  # one slot on half the rows, base rows on the rest: its own pair
