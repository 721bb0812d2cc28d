"""Triton: the batched LoRA delta of :mod:`kvscale.kernels.lora` as Punica's SGMV, two launches
per projection whatever the step's mix of adapters and base rows.

- shrink: per tile of rows of one slot, ``h = x[rows] @ A[slot]^T`` (``[rows, k]``, k up to the
  rank times the fused slices), accumulated in float32 over ``in`` and rounded to the dtype;
- expand: per tile and block of output columns, ``out[rows] += h @ B[slot]^T``.

Rows without an adapter are in no tile, so they cost nothing. The adapters' matrices stay where
the engine's device pool laid them out (server/worker/lora_layers.py, one A and one B per adapter
and projection, of the adapter's own rank): the kernels reach a slot's through its address in a
small per-slot table, as vLLM's LoRA kernels do, so nothing is stacked or copied per step.
The dots' operands and precision are decode_attention.py's ``dot_options``: IEEE float32 products
for float32 (as PyTorch's matmul computes them), bfloat16 widened where Triton's interpreter runs.

Importing this module imports triton; :mod:`kvscale.kernels.lora` does so only on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvscale.kernels.decode_attention import dot_options
from kvscale.kernels.lora import TILE_ROWS, LoRARows, LoRASlots

BLOCK_IN = 64  # shrink: input columns per step of its loop
BLOCK_N = 64  # expand: output columns per program


# The kernels' arguments stay unannotated (type: ignore below): Triton reads annotations as
# specialisation hints, and pointers have no Python type.
@triton.jit
def _shrink_kernel(x_ptr, table_ptr, rows_ptr, tiles_ptr, h_ptr, in_features,  # type: ignore[no-untyped-def]
                   x_row_stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_IN: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    k = tl.load(table_ptr + slot * 3 + 2)
    if k == 0:  # this slot's adapter leaves the projection alone
        return
    a_ptr = tl.load(table_ptr + slot * 3).to(tl.pointer_type(x_ptr.dtype.element_ty))
    m = tl.arange(0, BLOCK_M)
    m_mask = m < count
    rows = tl.load(rows_ptr + start + m, mask=m_mask, other=0)
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < k
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for col0 in range(0, in_features, BLOCK_IN):
        cols = col0 + tl.arange(0, BLOCK_IN)
        c_mask = cols < in_features
        xs = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :],
                     mask=m_mask[:, None] & c_mask[None, :], other=0.0)
        a_t = tl.load(a_ptr + kk[None, :] * in_features + cols[:, None],
                      mask=c_mask[:, None] & k_mask[None, :], other=0.0)  # A^T's [BLOCK_IN, BLOCK_K]
        acc = tl.dot(xs.to(DOT_DTYPE), a_t.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    h = h_ptr + (start + m)[:, None] * BLOCK_K + kk[None, :]
    tl.store(h, acc.to(h_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _expand_kernel(h_ptr, table_ptr, rows_ptr, tiles_ptr, out_ptr, out_features,  # type: ignore[no-untyped-def]
                   out_row_stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    k = tl.load(table_ptr + slot * 3 + 2)
    if k == 0:
        return
    b_ptr = tl.load(table_ptr + slot * 3 + 1).to(tl.pointer_type(out_ptr.dtype.element_ty))
    m = tl.arange(0, BLOCK_M)
    m_mask = m < count
    rows = tl.load(rows_ptr + start + m, mask=m_mask, other=0)
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < k
    h = tl.load(h_ptr + (start + m)[:, None] * BLOCK_K + kk[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    b_t = tl.load(b_ptr + n[None, :] * k + kk[:, None],
                  mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # B^T's [BLOCK_K, BLOCK_N]
    # Rounded to the dtype before the sum, as PyTorch's (h @ B^T) is before out += it.
    delta = tl.dot(h.to(DOT_DTYPE), b_t.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    delta = delta.to(out_ptr.dtype.element_ty).to(tl.float32)
    mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + rows[:, None] * out_row_stride + n[None, :]
    tl.store(out, (tl.load(out, mask=mask, other=0.0).to(tl.float32) + delta).to(out_ptr.dtype.element_ty),
             mask=mask)


def slot_table(slots: LoRASlots, x: Tensor, out_features: int) -> Tensor | None:
    """``slots``' per-slot (A's address, B's address, k) on ``x``'s device, made once and kept in
    ``slots``; None where a matrix does not fit the kernel (dtype, device, shape, layout)."""
    if slots.table is not None:
        return slots.table
    entries = []
    for pair in slots.pairs:
        if pair is None:
            entries.append((0, 0, 0))
            continue
        a, b = pair
        k = a.shape[0]
        fits = all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous() for t in pair)
        if not fits or a.dim() != 2 or a.shape[1] != x.shape[1] or tuple(b.shape) != (out_features, k):
            return None
        entries.append((a.data_ptr(), b.data_ptr(), k))
    slots.table = torch.tensor(entries, dtype=torch.int64).to(x.device)
    slots.max_k = max(k for _, _, k in entries)
    return slots.table


def add_lora(out: Tensor, x: Tensor, rows: LoRARows, slots: LoRASlots) -> bool:
    """:func:`kvscale.kernels.lora.add_lora` in two launches; False (nothing done) where the
    tensors' layout does not fit: the caller then runs the PyTorch form."""
    if (x.dim() != 2 or out.dim() != 2 or x.shape[0] != rows.num_rows or out.shape[0] != rows.num_rows
            or x.stride(1) != 1 or out.stride(1) != 1 or out.dtype != x.dtype):
        return False
    table = slot_table(slots, x, out.shape[1])
    if table is None:
        return False
    num_tiles = rows.tiles.shape[0]
    if num_tiles == 0 or slots.max_k == 0:
        return True
    block_k = max(16, triton.next_power_of_2(slots.max_k))  # tl.dot's smallest side is 16
    h = torch.empty((rows.sorted_rows.shape[0], block_k), dtype=x.dtype, device=x.device)
    _shrink_kernel[(num_tiles,)](
        x, table, rows.sorted_rows, rows.tiles, h, x.shape[1], x.stride(0),
        BLOCK_M=TILE_ROWS, BLOCK_K=block_k, BLOCK_IN=BLOCK_IN, num_warps=4, **dot_options(_shrink_kernel, x.dtype),
    )
    _expand_kernel[(num_tiles, triton.cdiv(out.shape[1], BLOCK_N))](
        h, table, rows.sorted_rows, rows.tiles, out, out.shape[1], out.stride(0),
        BLOCK_M=TILE_ROWS, BLOCK_K=block_k, BLOCK_N=BLOCK_N, num_warps=4, **dot_options(_expand_kernel, x.dtype),
    )
    return True


__all__ = ["add_lora", "slot_table"]
