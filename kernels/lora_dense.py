"""The batched LoRA contract (kernels/lora.py) as one pair of matmuls per projection over every
slot at once: the engine's path on CPU where a step's rows are few (docs/server.md, "LoRA
adapters").

The slots' matrices are stacked once, while they stay the step's (kept in
:class:`~kvscale.kernels.lora.LoRASlots`): A of every slot as the columns of ``a_all [in, S*w]``
and B as the rows of ``b_all [S*w, out]``, ``w`` the widest slot's ``k``, a narrower slot (or one
whose adapter leaves the projection alone) padded with zeros. Then ``h = x @ a_all`` holds every
row's product with every slot's A; each row keeps its own slot's ``w`` columns, the rest set to
zero (``masked_fill``, not a multiply by a 0/1 mask: another adapter's overflow would leak into
the row as ``0 * inf``), and ``out += h @ b_all``. The zeros add exactly nothing, so each row gets
the contract's delta, rounded where the reference rounds it (``h``, then ``h @ B^T``, then the
sum), its terms summed in another order.

It does every row against every slot's matrices, S times the reference's multiply-adds, but
reads each matrix once and has no per-slot call, gather or scatter: on few rows those are what the
reference's time goes to (docs/performance.md, multi-LoRA row), on many rows (a prefill) the
multiply-adds are. :func:`dense_pays` picks between the two.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvscale.kernels.lora import LoRARows, LoRASlots

# Rows x (S * w) up to which one product over every slot is taken. `python -m bench.lora_dense_pick`
# (bench/results/lora_dense_pick.json, 2 cores AVX2, the bundled model's projections, 8 slots
# held): with all 8 on the rows it beat the per-slot pairs at 16 rows on every projection but
# gate|up at rank 16 (2.1x faster on q|k|v at rank 8, 4.4x on o), and lost from 64 rows on q|k|v;
# with 2 of the 8 on the rows the pairs were as fast or faster from q|k|v and gate|up at 16 rows.
# The extra multiply-adds also grow with the projection's width: a rule by them is not made yet.
DENSE_MAX_ROW_COLUMNS = 64 * 256


def dense_pays(num_rows: int, num_groups: int, num_slots: int, columns: int) -> bool:
    """Whether :func:`dense_add_lora` beats the per-slot form on ``num_rows`` rows with
    ``num_groups`` of the ``num_slots`` slots present, ``columns`` (S * w) wide stacked: when
    there are two slots or more to call for (or one slot held: no other's matrices to read) and
    the extra multiply-adds stay few."""
    if num_groups < 2 and num_slots > 1:
        return False
    return num_rows * columns <= DENSE_MAX_ROW_COLUMNS


def stacked_columns(slots: LoRASlots) -> int:
    """S * w: the stacked matrices' inner width (:func:`stacked`)."""
    if slots.dense is not None:
        return slots.dense[1].shape[0]
    return len(slots.pairs) * max((pair[0].shape[0] for pair in slots.pairs if pair is not None), default=0)


def stacked(slots: LoRASlots, x: Tensor, out_features: int) -> tuple[Tensor, Tensor]:
    """``slots``' (a_all [in, S*w], b_all [S*w, out]) in ``x``'s dtype and device, made once and
    kept in ``slots``."""
    if slots.dense is not None:
        return slots.dense
    width = max((pair[0].shape[0] for pair in slots.pairs if pair is not None), default=0)
    a_all = torch.zeros(len(slots.pairs), width, x.shape[1], dtype=x.dtype, device=x.device)
    b_all = torch.zeros(len(slots.pairs), width, out_features, dtype=x.dtype, device=x.device)
    for s, pair in enumerate(slots.pairs):
        if pair is not None:
            a, b = pair
            a_all[s, :a.shape[0]] = a
            b_all[s, :a.shape[0]] = b.t()
    slots.dense = (a_all.view(-1, x.shape[1]).t().contiguous(), b_all.view(-1, out_features))
    return slots.dense


def off_slots(rows: LoRARows, num_slots: int) -> Tensor:
    """[rows, S, 1], True where a row's column block is not its slot's (every block of a base
    row); made once per step and slot count, kept in ``rows``."""
    found = rows.masks.get(num_slots)
    if found is None:
        slot_ids = torch.arange(num_slots, device=rows.row_slots.device)
        found = rows.masks[num_slots] = (rows.row_slots[:, None] != slot_ids[None, :]).unsqueeze(2)
    return found


def dense_add_lora(out: Tensor, x: Tensor, rows: LoRARows, slots: LoRASlots) -> None:
    """The contract in one pair of matmuls over every slot (the module's docstring)."""
    a_all, b_all = stacked(slots, x, out.shape[1])
    num_slots = len(slots.pairs)
    if a_all.shape[1] == 0:
        return
    h = x @ a_all
    h.view(x.shape[0], num_slots, -1).masked_fill_(off_slots(rows, num_slots), 0)
    out += h @ b_all


__all__ = ["DENSE_MAX_ROW_COLUMNS", "dense_add_lora", "dense_pays", "off_slots", "stacked", "stacked_columns"]
