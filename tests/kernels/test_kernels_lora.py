"""The batched LoRA contract (kernels/lora.py): a step's rows planned by slot, the PyTorch path
against the contract's per-row definition, the one-product path over every slot
(kernels/lora_dense.py) against that reference, and which path runs where. The Triton kernel
against the reference: test_kernels_triton_interpret.py (and test_kernels_gpu.py on a GPU)."""

from __future__ import annotations

import pytest
import torch
from lora_checks import LORA_TOLERANCE, make_lora_case

from kvscale.kernels.lora import (
    LoRASlots,
    add_lora,
    lora_path,
    lora_rows,
    plan_rows,
    torch_add_lora,
)
from kvscale.kernels.lora_dense import dense_add_lora, dense_pays


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


def test_another_slots_overflow_does_not_reach_a_row() -> None:
    # Row 0's product with slot 1's A overflows float32: masked, not multiplied by 0 (inf * 0 = nan).
    big = 2.0**100
    x = torch.tensor([[big, 1.0], [1.0, 1.0]])
    pairs = ((torch.tensor([[1 / big, 0.0]]), torch.ones(2, 1)), (torch.tensor([[big, 0.0]]), torch.ones(2, 1)))
    out = torch.zeros(2, 2)
    dense_add_lora(out, x, lora_rows([0, 1], torch.device("cpu")), LoRASlots(pairs))
    assert out[0].tolist() == [1.0, 1.0] and out[1].tolist() == [big, big]


def test_the_product_over_every_slot_runs_for_few_rows_of_several_slots() -> None:
    assert dense_pays(num_rows=16, num_groups=8, num_slots=8, columns=8 * 24)
    assert not dense_pays(num_rows=2048, num_groups=8, num_slots=8, columns=8 * 24)  # a prefill
    assert not dense_pays(num_rows=16, num_groups=1, num_slots=8, columns=8 * 24)  # one slot's rows
    assert dense_pays(num_rows=16, num_groups=1, num_slots=1, columns=24)  # ... and none other held
    gen = torch.Generator().manual_seed(2)
    case = make_lora_case(gen, torch.float32, rows=16, in_features=48, slice_width=40, slices=1,
                          ranks=[8, 8, 8], base_share=0.0)
    x, out, rows, slots = case.on("cpu")
    add_lora(out, x, rows, slots)
    assert slots.dense is not None  # add_lora took the product over every slot, and kept its stacking
