"""Triton: the mixture-of-experts block of :mod:`kvscale.kernels.moe` as two launches of one
grouped GEMM over blocks of rows of one expert.

The (token, slot) pairs are sorted by expert and padded into blocks of ``rows``
(:func:`kvscale.kernels.moe.align_by_block`); each program takes one block and ``BLOCK_N`` output
columns, and reads only its block's expert's weight tiles, so an expert no token chose costs
nothing and one chosen by a decode step's single token costs one block. The launches:

- gate|up: the block's tokens' rows of ``x`` times the expert's gate and up tiles (two float32
  accumulators over the same ``x`` tile), rounded to the dtype, then SiLU(gate) rounded and
  times up: the gated activation ``[pairs, inter]``, stored by pair;
- down: those rows times the expert's down tile, rounded, times the pair's routing weight,
  rounded: each pair's contribution ``[pairs, hidden]``.

A token's contributions are then summed in PyTorch in ascending expert order (each token's slots
sorted by expert first), so the result is deterministic and rounds as the reference's
``index_add_`` per expert does; no atomics. The experts' weights stay in their own modules'
tensors: the kernels reach expert e's through its address in a small table, as
:mod:`kvscale.kernels.lora_triton` reaches an adapter's. The dots' operands and precision are
decode_attention.py's ``dot_options``. The plan's shape (pair ids sorted by expert and padded
per block with a sentinel, a block-to-expert map, a grid sized for the worst routing) follows
vLLM's fused-MoE kernel; the code is written anew here, and its tile sizes are not tuned on a GPU.

Importing this module imports triton; :mod:`kvscale.kernels.moe` does so only on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvscale.kernels.decode_attention import dot_options
from kvscale.kernels.moe import (
    ExpertWeights,
    align_by_block,
    block_rows,
    check_routing,
    sum_by_expert,
)

BLOCK_N = 64  # output columns per program
BLOCK_K = 64  # input columns per step of its loop


# The kernel's arguments stay unannotated (type: ignore below): Triton reads annotations as
# specialisation hints, and pointers have no Python type.
@triton.jit
def _expert_gemm_kernel(a_ptr, table_ptr, pairs_ptr, block_experts_ptr, num_padded_ptr,  # type: ignore[no-untyped-def]
                        scale_ptr, out_ptr, num_pairs, n_out, k_in, a_row_stride,
                        TOP_K: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):  # past the blocks this routing fills
        return
    expert = tl.load(block_experts_ptr + block)
    w_ptr = tl.load(table_ptr + expert).to(tl.pointer_type(a_ptr.dtype.element_ty))
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs  # the padding's sentinel pairs are no rows
    # GATED reads x by token (pair // k); down reads the activation by pair.
    rows = (pairs // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < k_in
        a = tl.load(a_ptr + rows[:, None] * a_row_stride + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_t = tl.load(w_ptr + n[None, :].to(tl.int64) * k_in + kk[:, None], mask=w_mask, other=0.0)  # W^T's tile
        acc = tl.dot(a, w_t.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        if GATED:  # up's rows follow gate's in gate|up
            up_t = tl.load(w_ptr + (n[None, :] + n_out).to(tl.int64) * k_in + kk[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, up_t.to(DOT_DTYPE), acc_up, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    result = acc.to(dtype).to(tl.float32)
    if GATED:  # layer_ops' SiLU-and-multiply, with its roundings
        result = (result / (1.0 + tl.exp(-result))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    else:
        result = result * tl.load(scale_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * n_out + n[None, :]
    tl.store(out, result.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def expert_table(weights: ExpertWeights, x: Tensor) -> Tensor | None:
    """``weights``' per-expert addresses on ``x``'s device, made once and kept in ``weights``;
    None where a weight does not fit the kernel (dtype, device, shape, layout)."""
    if weights.table is not None:
        return weights.table
    hidden, inter = x.shape[1], weights.intermediate
    for gate_up, down in zip(weights.gate_up, weights.down, strict=True):
        fits = all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous() for t in (gate_up, down))
        if not fits or tuple(gate_up.shape) != (2 * inter, hidden) or tuple(down.shape) != (hidden, inter):
            return None
    weights.table = torch.tensor([[t.data_ptr() for t in weights.gate_up], [t.data_ptr() for t in weights.down]],
                                 dtype=torch.int64).to(x.device)
    return weights.table


def fused_moe(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor) -> Tensor | None:
    """:func:`kvscale.kernels.moe.torch_fused_moe` in two launches and a sum; None (nothing done)
    where the tensors do not fit the kernel: the caller then runs the PyTorch form."""
    check_routing(x, weights, topk_weights, topk_ids)
    if x.stride(1) != 1 or not x.dtype.is_floating_point:
        return None
    table = expert_table(weights, x)
    if table is None:
        return None
    tokens, hidden = x.shape
    top_k, inter, num_experts = topk_ids.shape[1], weights.intermediate, weights.num_experts
    if tokens == 0:
        return torch.zeros_like(x)
    # Each token's slots in ascending expert order: pair token * k + j is its j-th smallest expert,
    # so that the sum below adds them in the reference's order.
    ids, slot_order = topk_ids.sort(dim=1)
    scales = topk_weights.gather(1, slot_order).contiguous()
    num_pairs = tokens * top_k
    plan = align_by_block(ids, num_experts, block_rows(num_pairs, num_experts))
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    contributions = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    num_blocks = plan.block_experts.shape[0]
    common = {"BLOCK_M": plan.rows, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "num_warps": 4,
              **dot_options(_expert_gemm_kernel, x.dtype)}
    _expert_gemm_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, table[0], plan.pairs, plan.block_experts, plan.num_padded, scales, act, num_pairs, inter, hidden,
        x.stride(0), TOP_K=top_k, GATED=True, **common,
    )
    _expert_gemm_kernel[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
        act, table[1], plan.pairs, plan.block_experts, plan.num_padded, scales, contributions, num_pairs, hidden,
        inter, inter, TOP_K=1, GATED=False, **common,
    )
    return sum_by_expert(contributions.view(tokens, top_k, hidden))


__all__ = ["BLOCK_K", "BLOCK_N", "expert_table", "fused_moe"]
