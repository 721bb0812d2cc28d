"""The batched LoRA contract (kernels/lora.py) in C on CPUs, each row multiplied by its own slot's
matrices only (cpu_lora.c, Punica's SGMV): the engine's CPU path for decode steps, and for
prefills where it beats PyTorch's GEMMs (docs/server.md, "LoRA adapters").

Each slot's B is laid out once per slot set, while the matrices stay the step's (kept in
:class:`~kvscale.kernels.lora.LoRASlots`): slice by slice, its block transposed (``[r, width_j]``
at element ``r * first_j``), so a fused projection's zero blocks are neither held nor multiplied;
A is read where the adapter holds it. A table of (A's address, B^T's address, rank per slice) per
slot is what the kernel reads, with the step's rows as :func:`~kvscale.kernels.lora.lora_rows`
planned them (tiles of one slot's rows).

Where it runs is :func:`native_pays`: float32 and bfloat16 on the CPU, up to a number of rows by
dtype and slots present; longer steps keep PyTorch's per-slot GEMMs. Where the C kernels do not build,
PyTorch's forms run (kernels/lora_dense.py's stacked one or the per-slot pairs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kvscale.kernels.cpu_build import library
from kvscale.kernels.lora import LoRARows, LoRASlots

# The most rows the kernel takes, of several slots and of one; past them PyTorch's per-slot pairs.
# A layer's four projections of the bundled model, 8 slots of rank 8 held, 2 threads, Zen 5 EPYC
# (bench/results/lora_cpu_pick.json, `python -m bench.lora_dense_pick --present 8,1 --dtype
# float32,bfloat16`): in float32 the kernel took under half the pairs' time at every row count to
# 4,096 (16 rows of 8 slots: 0.07 ms, the stacked path 0.29, the pairs 1.17; 2,048 rows of one:
# 3.0 against 6.3 ms); in bfloat16, where oneDNN's GEMM has the CPU's bf16 dot products, one slot's
# rows past 512 run faster as its pair (1,024 rows: 1.59 against 1.39 ms), 8 slots' do not (1.59
# against 4.96).
ROWS_MAX = {torch.float32: 4096, torch.bfloat16: 4096}
ONE_SLOT_ROWS_MAX = {torch.float32: 4096, torch.bfloat16: 512}
_NO_MEMORY = 2  # cpu_lora.c's KVSCALE_LORA_NO_MEMORY


@dataclass(frozen=True)
class SlotTable:
    """One projection's slots as cpu_lora.c reads them (the module's docstring)."""

    table: Tensor  # int64 [slots, 3]: A's address, B^T's address, rank per slice (0: none)
    slices: Tensor  # int64 [n, 2]: (first output column, width) of each fused slice
    held: tuple[Tensor, ...]  # the tensors the addresses point into, alive as long as the table
    dtype: torch.dtype


@functools.cache
def native_available() -> bool:
    """Whether the C kernels run in this process (cpu_build.library)."""
    return library() is not None


def native_pays(num_rows: int, slots_present: int, dtype: torch.dtype, on_cpu: bool, available: bool) -> bool:
    """Whether a step of ``num_rows`` rows of ``slots_present`` slots takes the C kernel: on the
    CPU, where it builds, in a dtype it takes, up to ``ROWS_MAX`` rows of that dtype
    (``ONE_SLOT_ROWS_MAX`` where one slot holds them)."""
    limit = (ONE_SLOT_ROWS_MAX if slots_present <= 1 else ROWS_MAX).get(dtype, 0)
    return on_cpu and available and 0 < num_rows <= limit


def slot_table(slots: LoRASlots, dtype: torch.dtype, out_features: int) -> SlotTable:
    """``slots``' table for tensors of ``dtype``, made once and kept in ``slots``."""
    found = slots.native
    if found is not None and found.dtype == dtype:
        return found
    layout = slots.slices or ((0, out_features),)
    n = len(layout)
    held: list[Tensor] = []
    entries: list[tuple[int, int, int]] = []
    for pair in slots.pairs:
        if pair is None:
            entries.append((0, 0, 0))
            continue
        a, b = pair
        r = a.shape[0] // n
        a = a.to(dtype).contiguous()
        bt = torch.cat([b[first:first + size, j * r:(j + 1) * r].t().reshape(-1)
                        for j, (first, size) in enumerate(layout)]).to(dtype).contiguous()
        held += [a, bt]
        entries.append((a.data_ptr(), bt.data_ptr(), r))
    slots.native = SlotTable(torch.tensor(entries, dtype=torch.int64).reshape(-1, 3),
                             torch.tensor(layout, dtype=torch.int64).reshape(-1, 2), tuple(held), dtype)
    return slots.native


def native_add_lora(out: Tensor, x: Tensor, rows: LoRARows, slots: LoRASlots) -> None:
    """The contract in one C call (``x`` [rows, in], ``out`` [rows, out], one dtype, each with a
    unit column stride): each row of a slot gets its own slot's delta, other rows are untouched."""
    assert x.dtype == out.dtype and x.stride(1) == 1 and out.stride(1) == 1
    table = slot_table(slots, x.dtype, out.shape[1])
    lib = library()
    assert lib is not None  # native_pays() said so
    status = lib.kvscale_lora_sgmv(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows.sorted_rows.data_ptr(),
        rows.sorted_rows.shape[0], rows.tiles.data_ptr(), rows.tiles.shape[0], table.table.data_ptr(),
        table.table.shape[0], table.slices.data_ptr(), table.slices.shape[0], x.shape[1],
        int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if status == _NO_MEMORY:
        raise MemoryError("the LoRA kernel could not allocate its scratch")


__all__ = ["ONE_SLOT_ROWS_MAX", "ROWS_MAX", "SlotTable", "native_add_lora", "native_available", "native_pays",
           "slot_table"]
