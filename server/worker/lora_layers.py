"""LoRA on the decoder's fused projections: the base GEMM for every row, plus each adapter's
low-rank delta on the rows that carry it (docs/server.md, "LoRA adapters").

A step's adapters take a slot each and its rows are planned by slot (``LoRABatch``, set once per
step by lora_manager.py and shared by every wrapped projection), so one forward serves base rows
and several adapters: the delta is kernels/lora.py's batched LoRA, two Triton launches on a GPU,
on CPU one C call with each row through its own adapter's matrices (kernels/lora_cpu.py), or
without the C kernels one shrink over every slot and one expand per slice, or two small matmuls
per adapter present (kernels/lora_dense.py chooses). The checkpoint's q|k|v and gate|up are fused in one
projection (model_llama.py), so an adapter's A matrices for the slices are stacked and its B
matrices laid block-diagonally: one delta fills every slice; the slices' columns are passed with
the matrices, so that the CPU path's expand reads each slice's block only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvscale.kernels.lora import LoRARows, LoRASlots, add_lora
from kvscale.server.worker.lora_adapter import LoRAAdapter


@dataclass
class LoRADeviceAdapter:
    """One adapter's weights as the wrapped projections use them, on the model's device."""

    name: str
    # wrapped projection's key -> (A [slices * r, in], B [out, slices * r], scaling folded in);
    # a projection the adapter does not target has no entry.
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoRABatch:
    """This step's adapters (slot i holds ``adapters[i]``), its rows by slot (None for a step of
    base rows only), and each wrapped projection's matrices by slot (a projection no adapter of
    the step targets has no entry)."""

    adapters: tuple[LoRADeviceAdapter, ...] = ()
    rows: LoRARows | None = None
    weights: dict[tuple[int, str], LoRASlots] = field(default_factory=dict)
    # Each wrapped projection's fused slices, (first output column, width), set as it is wrapped.
    slices: dict[tuple[int, str], tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def set_step(self, adapters: tuple[LoRADeviceAdapter, ...], rows: LoRARows | None,
                 keys: list[tuple[int, str]]) -> None:
        """Make ``adapters`` the slots and ``rows`` the rows; the projections' matrices are laid
        out again only when the adapters changed (a kernel's slot tables are kept with them)."""
        same = len(adapters) == len(self.adapters) and all(
            a is b for a, b in zip(adapters, self.adapters, strict=True))
        if not same:
            self.adapters = adapters
            self.weights = {}
            for key in keys:
                pairs = tuple(adapter.fused.get(key) for adapter in adapters)
                if any(pair is not None for pair in pairs):
                    self.weights[key] = LoRASlots(pairs, self.slices.get(key, ()))
        self.rows = rows

    @property
    def groups(self) -> list[tuple[LoRADeviceAdapter, torch.Tensor | None]]:
        """This step's rows by adapter: (adapter, rows), rows None when it is every row."""
        return [] if self.rows is None else [(self.adapters[slot], rows) for slot, rows in self.rows.groups]

    def forget(self) -> None:
        """Drop the slots (an adapter unloaded: its matrices must not outlive it here)."""
        self.adapters, self.rows, self.weights = (), None, {}


@dataclass(frozen=True)
class Slice:
    module: str  # the checkpoint's (PEFT's) module name, e.g. "k_proj"
    offset: int  # where its output starts in the fused projection's
    size: int


class LoRALinear(nn.Module):
    """A projection with LoRA deltas added for the rows of this step's adapters."""

    def __init__(self, base: nn.Module, key: tuple[int, str], slices: tuple[Slice, ...], in_features: int,
                 batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.key = key  # (layer index, fused projection name)
        self.slices = slices
        self.in_features = in_features
        self.out_features = sum(s.size for s in slices)
        self.batch = batch
        if len(slices) > 1:
            batch.slices[key] = tuple((s.offset, s.size) for s in slices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows, slots = self.batch.rows, self.batch.weights.get(self.key)
        if rows is not None and slots is not None:
            add_lora(out, x, rows, slots)
        return out


def fuse_adapter(adapter: LoRAAdapter, wrapped: list[LoRALinear], dtype: torch.dtype,
                 device: torch.device) -> LoRADeviceAdapter:
    """``adapter`` laid out for ``wrapped`` (ValueError where a matrix does not fit the model)."""
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    known = {(w.key[0], s.module) for w in wrapped for s in w.slices}
    stray = sorted(set(adapter.weights) - known)
    if stray:
        raise ValueError(f"LoRA adapter {adapter.name!r}: the model has no layer {stray[0][0]} {stray[0][1]}")
    r = adapter.rank
    for proj in wrapped:
        layer = proj.key[0]
        if not any((layer, s.module) in adapter.weights for s in proj.slices):
            continue
        a = torch.zeros(len(proj.slices) * r, proj.in_features, dtype=torch.float32)
        b = torch.zeros(proj.out_features, len(proj.slices) * r, dtype=torch.float32)
        for i, s in enumerate(proj.slices):
            pair = adapter.weights.get((layer, s.module))
            if pair is None:
                continue
            a_s, b_s = pair
            if a_s.shape[1] != proj.in_features or b_s.shape[0] != s.size:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {s.module} has A {tuple(a_s.shape)}, "
                                 f"B {tuple(b_s.shape)}; the model's projection is {proj.in_features} -> {s.size}")
            a[i * r:(i + 1) * r] = a_s.float()
            b[s.offset:s.offset + s.size, i * r:(i + 1) * r] = b_s.float() * adapter.scaling
        fused[proj.key] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    return LoRADeviceAdapter(adapter.name, fused)
