"""A step's LoRA slots (server/worker/lora_layers.py's ``LoRABatch``): each projection's matrices by
slot laid out once while the step's adapters stay the same, and a projection adding only its own
adapters' deltas. The deltas' arithmetic: tests/kernels/test_kernels_lora.py."""

from __future__ import annotations

import torch
from torch import nn

from kvscale.kernels.lora import lora_rows
from kvscale.server.worker.lora_layers import LoRABatch, LoRADeviceAdapter, LoRALinear, Slice

QKV, DOWN = (0, "qkv_proj"), (0, "down_proj")


def _adapter(name: str, keys: list[tuple[int, str]]) -> LoRADeviceAdapter:
    return LoRADeviceAdapter(name, {key: (torch.randn(2, 4), torch.randn(4, 2)) for key in keys})


def test_the_slots_are_laid_out_again_only_when_the_adapters_change() -> None:
    batch = LoRABatch()
    a1, a2 = _adapter("a1", [QKV]), _adapter("a2", [QKV])
    cpu = torch.device("cpu")
    batch.set_step((a1, a2), lora_rows([0, 1, -1], cpu), [QKV, DOWN])
    assert set(batch.weights) == {QKV}  # no adapter of the step targets down_proj
    laid_out = batch.weights[QKV]
    batch.set_step((a1, a2), lora_rows([1, 1, 0], cpu), [QKV, DOWN])
    assert batch.weights[QKV] is laid_out  # a kernel's slot table, kept with it, stays valid
    assert [(adapter.name, rows if rows is None else rows.tolist()) for adapter, rows in batch.groups] == [
        ("a1", [2]), ("a2", [0, 1])]
    batch.set_step((a2, a1), lora_rows([0, 1, 1], cpu), [QKV, DOWN])
    assert batch.weights[QKV] is not laid_out and batch.weights[QKV].pairs[0] is a2.fused[QKV]
    batch.forget()
    assert batch.adapters == () and batch.weights == {} and batch.groups == []


def test_a_projection_adds_only_its_rows_adapters_deltas() -> None:
    batch = LoRABatch()
    base = nn.Linear(4, 4, bias=False)
    proj = LoRALinear(base, QKV, (Slice("q_proj", 0, 4),), 4, batch)
    a1, a2 = _adapter("a1", [QKV]), _adapter("a2", [DOWN])
    batch.set_step((a1, a2), lora_rows([-1, 0, 1], torch.device("cpu")), [QKV, DOWN])
    x = torch.randn(3, 4)
    with torch.no_grad():
        out, plain = proj(x), base(x)
    a, b = a1.fused[QKV]
    assert torch.allclose(out[1], plain[1] + b @ (a @ x[1]), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[[0, 2]], plain[[0, 2]])  # a base row, and a2 leaves qkv_proj alone


def test_a_fused_projections_slices_come_with_its_matrices() -> None:
    # So that the CPU path's expand reads each slice's block of B only (kernels/lora_dense.py).
    batch = LoRABatch()
    LoRALinear(nn.Linear(4, 4, bias=False), QKV, (Slice("q_proj", 0, 2), Slice("k_proj", 2, 1), Slice("v_proj", 3, 1)),
               4, batch)
    LoRALinear(nn.Linear(4, 4, bias=False), DOWN, (Slice("down_proj", 0, 4),), 4, batch)
    batch.set_step((_adapter("a1", [QKV, DOWN]),), lora_rows([0], torch.device("cpu")), [QKV, DOWN])
    assert batch.weights[QKV].slices == ((0, 2), (2, 1), (3, 1))
    assert batch.weights[DOWN].slices == ()  # one slice: nothing to split
