"""The batched LoRA contract (kernels/lora.py) over every slot at once: one shrink per projection
and one expand per fused slice, the engine's path on CPU where the C kernels do not build
(kernels/lora_cpu.py runs where they do) and a step's rows are few and of several slots
(docs/server.md, "LoRA adapters").

The slots' matrices are stacked once, while they stay the step's (kept in
:class:`~kvscale.kernels.lora.LoRASlots`). A fused projection (q|k|v, gate|up) has ``n`` slices,
each slot's A the slices' A matrices stacked on the rank axis and its B block-diagonal (slice
``j``'s output columns read only rank columns ``j*r .. (j+1)*r``); a plain one has one slice. The
stacking is slice-major: ``a_all [in, n*S*w]`` holds, slice after slice, every slot's ``w``
rank columns for that slice (``w`` the widest slot's ``r``, a narrower slot or one whose adapter
leaves the projection alone padded with zeros), and ``b_j [S*w, size_j]`` each slot's block of
slice ``j`` only: the zero blocks of a block-diagonal B are never stored or multiplied.

Then ``h = x @ a_all`` holds every row's product with every slot's A for every slice (one
shrink, shared by the slices); each row keeps its own slot's columns, the rest set to zero
(``masked_fill``, not a multiply by a 0/1 mask: another adapter's overflow would leak into the row
as ``0 * inf``), and slice by slice ``out[:, slice j] += h_j @ b_j``. The zeros add exactly
nothing, so each row gets the contract's delta, its terms summed in another order; base rows
and rows whose adapter leaves the projection alone are left bit for bit.

It does every row against every slot's matrices, about S times the per-slot path's multiply-adds
on the slots present, but makes ``2 + n`` calls however many slots the rows hold, where the
per-slot path makes four per slot present (a gather, two matmuls, a scatter): on few rows the
calls are what the time goes to, on many rows (a prefill) the multiply-adds are.
:func:`stacked_pays` weighs the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvscale.kernels.lora import LoRARows, LoRASlots

# A torch call's fixed cost (dispatch, allocation, a thread team's wake-up), in multiply-adds of
# a small float32 matmul's time: fitted, time = MACs / rate + calls * cost, on
# bench/results/lora_dense_pick.json's cases (2 vCPUs, AVX2 EPYC): the per-slot path's calls cost
# about 16 µs at 25 GMAC/s, the stacked path's 14 µs at 46 GMAC/s, 0.4 to 0.64 M multiply-adds;
# the lower taken, so the stacked path is chosen only where it clearly does fewer.
CALL_MACS = 400_000


@dataclass(frozen=True)
class Stacked:
    """One projection's slots stacked (the module's docstring)."""

    a_all: Tensor  # [in, n * S * w], slice-major
    b_slices: tuple[tuple[int, int, Tensor], ...]  # per slice: (first output column, width, b_j [S * w, width])
    num_slots: int
    width: int  # w


def slot_rank(pair: tuple[Tensor, Tensor] | None, num_slices: int) -> int:
    """A slot's rank per slice (0 for none): its A's rows over the projection's slices."""
    return 0 if pair is None else pair[0].shape[0] // num_slices


def slice_layout(slots: LoRASlots, out_features: int) -> tuple[tuple[int, int], ...]:
    """(first output column, width) of each fused slice; one covering ``out_features`` where the
    slots say none."""
    return slots.slices or ((0, out_features),)


def stacked_macs(num_rows: int, in_features: int, slice_widths: Sequence[int], num_slots: int, width: int) -> int:
    """Multiply-adds of :func:`dense_add_lora`: the shrink over every slot's columns of every
    slice, then each slice's expand over every slot's ``width`` columns into its own outputs."""
    return num_rows * num_slots * width * (len(slice_widths) * in_features + sum(slice_widths))


def per_slot_macs(group_rows: Sequence[int], group_ks: Sequence[int], in_features: int, out_features: int) -> int:
    """Multiply-adds of the per-slot path (``torch_add_lora``): each slot present, its rows
    through its A [k, in] and its whole B [out, k], the zero blocks of a fused one included."""
    return sum(n * k * (in_features + out_features) for n, k in zip(group_rows, group_ks, strict=True))


def stacked_pays(stacked: int, stacked_calls: int, per_slot: int, per_slot_calls: int) -> bool:
    """Whether the stacked path (``stacked`` multiply-adds in ``stacked_calls`` calls) costs no
    more than the per-slot path (``per_slot`` in ``per_slot_calls``), a call weighed as
    ``CALL_MACS`` multiply-adds."""
    return stacked + CALL_MACS * stacked_calls <= per_slot + CALL_MACS * per_slot_calls


def choose_stacked(rows: LoRARows, slots: LoRASlots, in_features: int, out_features: int) -> bool:
    """:func:`stacked_pays` for this step's rows on one projection's slots (made once per step
    and projection, kept in ``rows``)."""
    found = rows.choices.get(id(slots))
    if found is None:
        layout = slice_layout(slots, out_features)
        n = len(layout)
        width = max((slot_rank(pair, n) for pair in slots.pairs), default=0)
        present = [(slot, idx) for slot, idx in rows.groups if slots.pairs[slot] is not None]
        group_rows = [rows.num_rows if idx is None else idx.shape[0] for _, idx in present]
        group_ks = [n * slot_rank(slots.pairs[slot], n) for slot, _ in present]
        found = stacked_pays(
            stacked_macs(rows.num_rows, in_features, [size for _, size in layout], len(slots.pairs), width), 2 + n,
            per_slot_macs(group_rows, group_ks, in_features, out_features), 4 * len(present))
        rows.choices[id(slots)] = found
    return found


def stacked(slots: LoRASlots, x: Tensor, out_features: int) -> Stacked:
    """``slots``' matrices stacked in ``x``'s dtype and device, made once and kept in ``slots``."""
    if slots.dense is not None:
        return slots.dense
    layout = slice_layout(slots, out_features)
    n, num_slots, in_features = len(layout), len(slots.pairs), x.shape[1]
    width = max((slot_rank(pair, n) for pair in slots.pairs), default=0)
    a_all = torch.zeros(n, num_slots, width, in_features, dtype=x.dtype, device=x.device)
    b_all = [torch.zeros(num_slots, width, size, dtype=x.dtype, device=x.device) for _, size in layout]
    for s, pair in enumerate(slots.pairs):
        if pair is None:
            continue
        a, b = pair
        r = slot_rank(pair, n)
        for j, (first, size) in enumerate(layout):
            a_all[j, s, :r] = a[j * r:(j + 1) * r]
            b_all[j][s, :r] = b[first:first + size, j * r:(j + 1) * r].t()
    slots.dense = Stacked(a_all.view(-1, in_features).t().contiguous(),
                          tuple((first, size, b.view(-1, size)) for (first, size), b in zip(layout, b_all, strict=True)),
                          num_slots, width)
    return slots.dense


def off_slots(rows: LoRARows, num_slots: int, num_slices: int, width: int) -> Tensor:
    """[rows, n*S*w], True where a column of ``h`` is not in its row's slot's blocks (every
    column of a base row); made once per step and layout, kept in ``rows``. Laid out whole, not
    broadcast: ``masked_fill_`` takes half the time on a mask of its own shape."""
    key = (num_slots, num_slices, width)
    found = rows.masks.get(key)
    if found is None:
        slot_ids = torch.arange(num_slots, device=rows.row_slots.device)
        off = (rows.row_slots[:, None] != slot_ids[None, :])[:, None, :, None]
        found = rows.masks[key] = off.expand(-1, num_slices, -1, width).reshape(rows.num_rows, -1).contiguous()
    return found


def dense_add_lora(out: Tensor, x: Tensor, rows: LoRARows, slots: LoRASlots) -> None:
    """The contract in one shrink and one expand per slice over every slot (the module's docstring)."""
    st = stacked(slots, x, out.shape[1])
    if st.width == 0:
        return
    h = x @ st.a_all
    columns = st.num_slots * st.width
    h.masked_fill_(off_slots(rows, st.num_slots, len(st.b_slices), st.width), 0)
    for j, (first, size, b) in enumerate(st.b_slices):
        out[:, first:first + size].addmm_(h[:, j * columns:(j + 1) * columns], b)


__all__ = ["CALL_MACS", "Stacked", "choose_stacked", "dense_add_lora", "off_slots", "per_slot_macs", "slice_layout",
           "slot_rank", "stacked", "stacked_macs", "stacked_pays"]
