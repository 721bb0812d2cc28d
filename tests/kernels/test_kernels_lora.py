"""The batched LoRA contract (kernels/lora.py): a step's rows planned by slot, the PyTorch path
against the contract's per-row definition, and which path runs where. The Triton kernel against
this PyTorch path: test_kernels_triton_interpret.py (and test_kernels_gpu.py on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.lora import LoRASlots, lora_path, lora_rows, plan_rows, torch_add_lora


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
