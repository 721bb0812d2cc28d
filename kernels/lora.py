"""Batched LoRA: every row of a step's flattened tokens adds its own adapter's low-rank delta (or
none), for all the step's adapters in one call per projection (docs/server.md, "LoRA adapters").

The contract, written once here: each row ``i`` whose slot ``s = row_slots[i]`` is not -1 gets
``out[i] += (x[i] @ A[s]^T) @ B[s]^T``, where slot ``s`` holds ``A [k, in]`` and ``B [out, k]``
(the adapter's scaling folded into B; ``k`` its rank times the projection's fused slices) or
nothing for a projection its adapter leaves alone. Each product is rounded to the tensors' dtype
where PyTorch's matmuls round it: ``h = x @ A^T``, then ``h @ B^T``, then the sum.

These paths implement it:

- :func:`torch_add_lora`: a pair of matmuls per slot on that slot's rows; the reference the
  others must match, and the engine's path on CPU for the longest steps, or for a prefill or
  one slot where the C kernels do not build;
- :mod:`kvscale.kernels.lora_cpu`: SGMV in C (cpu_lora.c), each row through its own slot's
  matrices in one call per projection; the engine's path on CPU for decode steps and for
  prefills up to its rows' limit;
- :mod:`kvscale.kernels.lora_dense`: one shrink over every slot at once and one expand per fused
  slice, each row keeping its own slot's columns; the CPU path where the C kernels do not build
  and it costs less than the per-slot pairs (few rows of several slots: decode);
- :mod:`kvscale.kernels.lora_triton`: Punica's SGMV (segmented gather matrix-vector) as two
  Triton launches, shrink then expand, over tiles of rows of one slot; the path on CUDA.

A step's rows are planned once (:func:`lora_rows`), in the forms both paths read, and shared by
every projection of the step. Importing this module does not import Triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from kvscale.kernels import use_triton

if TYPE_CHECKING:
    from kvscale.kernels.lora_cpu import SlotTable
    from kvscale.kernels.lora_dense import Stacked

# Rows per Triton program: a tile holds rows of one slot only, so that one A and one B serve it
# (tl.dot needs at least 16 rows).
TILE_ROWS = 16


@dataclass(frozen=True)
class RowPlan:
    """A step's rows by slot, on the host: what :func:`lora_rows` moves to the device."""

    sorted_rows: np.ndarray  # int64: the rows with a slot, slot by slot, in row order within one
    segments: list[tuple[int, int, int]]  # (slot, start, end) in sorted_rows, one per slot present
    tiles: np.ndarray  # int64 [n, 3]: (slot, start in sorted_rows, rows) of at most TILE_ROWS rows
    every_row: bool  # one slot holds every row (the delta needs no row indices)


def plan_rows(row_slots: Sequence[int] | np.ndarray, tile_rows: int = TILE_ROWS) -> RowPlan:
    """Group the rows of ``row_slots`` (each row's slot, -1 for none) by slot, and cut each
    slot's rows into tiles of at most ``tile_rows``."""
    slots = np.asarray(row_slots, dtype=np.int64)
    order = np.argsort(slots, kind="stable")
    order = order[slots[order] >= 0]
    present, starts, counts = np.unique(slots[order], return_index=True, return_counts=True)
    segments = [(int(s), int(b), int(b + c)) for s, b, c in zip(present, starts, counts, strict=True)]
    tiles = [(slot, off, min(tile_rows, end - off)) for slot, start, end in segments
             for off in range(start, end, tile_rows)]
    return RowPlan(sorted_rows=order.astype(np.int64), segments=segments,
                   tiles=np.asarray(tiles, dtype=np.int64).reshape(-1, 3),
                   every_row=len(segments) == 1 and len(order) == len(slots))


@dataclass(frozen=True)
class LoRARows:
    """A step's rows by slot on the model's device, in the forms the two paths read."""

    num_rows: int
    # For torch_add_lora: each slot present and its rows (None where the slot holds every row).
    groups: tuple[tuple[int, Tensor | None], ...]
    sorted_rows: Tensor  # for the kernel: RowPlan.sorted_rows
    tiles: Tensor  # for the kernel: RowPlan.tiles
    row_slots: Tensor  # for lora_dense: each row's slot, -1 for none
    # lora_dense's masks of the rows' own slots, by (slots, slices, width): made once per step.
    masks: dict[tuple[int, int, int], Tensor] = field(default_factory=dict, compare=False, repr=False)
    # lora_dense's choice of path by projection's slots (their id, alive through the step).
    choices: dict[int, bool] = field(default_factory=dict, compare=False, repr=False)


def lora_rows(row_slots: Sequence[int] | np.ndarray, device: torch.device) -> LoRARows:
    """``row_slots`` (each row's slot, -1 for none) planned and moved to ``device`` in one copy."""
    plan = plan_rows(row_slots)
    slots = np.asarray(row_slots, dtype=np.int64)
    packed = torch.from_numpy(np.concatenate([slots, plan.sorted_rows, plan.tiles.reshape(-1)])).to(device)
    num_rows, n = len(slots), len(plan.sorted_rows)
    sorted_rows, tiles = packed[num_rows:num_rows + n], packed[num_rows + n:].view(-1, 3)
    groups = tuple((slot, None if plan.every_row else sorted_rows[start:end]) for slot, start, end in plan.segments)
    return LoRARows(num_rows, groups, sorted_rows, tiles, packed[:num_rows])


@dataclass
class LoRASlots:
    """One projection's matrices by slot: (A [k, in], B [out, k]), or None for a slot whose
    adapter leaves the projection alone."""

    pairs: tuple[tuple[Tensor, Tensor] | None, ...]
    # A fused projection's slices, (first output column, width) each, where B is block-diagonal by
    # them: each slot's k is n equal rank blocks, slice j's outputs reading block j only (as
    # server/worker/lora_layers.py's fuse_adapter lays it out). Empty: no such structure promised.
    slices: tuple[tuple[int, int], ...] = ()
    # The kernel's per-slot (A's address, B's address, k) on the device and the largest k, made on
    # its first launch (kvscale.kernels.lora_triton) and kept while these matrices are the step's.
    table: Tensor | None = field(default=None, repr=False)
    max_k: int = 0
    # kernels.lora_dense's every slot stacked (A's [in, n*S*w], B's [S*w, width] per slice), made
    # on its first use and kept while these matrices are the step's.
    dense: Stacked | None = field(default=None, repr=False)
    # kernels.lora_cpu's slot table (each slot's B^T laid out by slice), made on its first use.
    native: SlotTable | None = field(default=None, repr=False)


def torch_add_lora(out: Tensor, x: Tensor, rows: LoRARows, slots: LoRASlots) -> None:
    """The contract in PyTorch: per slot present, two matmuls on its rows added into ``out``."""
    for slot, idx in rows.groups:
        pair = slots.pairs[slot]
        if pair is None:
            continue
        a, b = pair
        if idx is None:
            out += (x @ a.t()) @ b.t()
        else:
            out.index_add_(0, idx, (x.index_select(0, idx) @ a.t()) @ b.t())


def lora_path(device: torch.device) -> str:
    """Which path adds the deltas for tensors on ``device``: "triton" (CUDA, or forced as
    :func:`kvscale.kernels.use_triton` says) or "torch"."""
    return "triton" if use_triton(device) else "torch"


def add_lora(out: Tensor, x: Tensor, rows: LoRARows, slots: LoRASlots) -> None:
    """Add each row's adapter delta into ``out`` (``x`` [rows, in], ``out`` [rows, out]): in
    Triton on a GPU where the tensors' layout fits the kernel; on a CPU in C where that pays
    (:func:`kvscale.kernels.lora_cpu.native_pays`); else in PyTorch: over every slot at once
    where that costs less (:func:`kvscale.kernels.lora_dense.choose_stacked`), else slot by slot."""
    if lora_path(x.device) == "triton":
        from kvscale.kernels import lora_triton

        if lora_triton.add_lora(out, x, rows, slots):
            return
    from kvscale.kernels import lora_cpu

    available = x.device.type == "cpu" and lora_cpu.native_available()
    if (lora_cpu.native_pays(rows.num_rows, len(rows.groups), x.dtype, x.device.type == "cpu", available)
            and x.stride(1) == 1 and out.stride(1) == 1 and out.dtype == x.dtype):
        lora_cpu.native_add_lora(out, x, rows, slots)
        return
    # Where the C kernel runs, a longer step's PyTorch form is the per-slot pairs: no stacked copy
    # of the slots besides its slot tables.
    if not available and rows.groups and rows.groups[0][1] is not None:  # a slot on every row: two matmuls already
        from kvscale.kernels import lora_dense

        if lora_dense.choose_stacked(rows, slots, x.shape[1], out.shape[1]):
            lora_dense.dense_add_lora(out, x, rows, slots)
            return
    torch_add_lora(out, x, rows, slots)


__all__ = ["LoRARows", "LoRASlots", "RowPlan", "TILE_ROWS", "add_lora", "lora_path", "lora_rows", "plan_rows",
           "torch_add_lora"]
