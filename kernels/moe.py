"""Fused mixture-of-experts: the contract, the rows' plan by expert, the PyTorch reference, and
which path runs where (docs/engine.md, "Model families").

The contract, written once here. ``x`` ``[tokens, hidden]``; expert e's gate|up ``[2 * inter,
hidden]`` and down ``[hidden, inter]`` (``nn.Linear`` weights, gate first); ``topk_ids`` and
``topk_weights`` ``[tokens, k]`` (each token's k distinct experts and their weights, float32 or
x's dtype). Each (token, expert) pair's contribution is rounded to x's dtype where
server/worker/moe.py's per-expert modules round it: the gate|up product, SiLU(gate) (as
:func:`kvscale.kernels.layer_ops.torch_silu_and_mul`), its product with up, the down product, and
that times the routing weight. A token's output sums its k contributions in x's dtype in
ascending expert order, starting from zero, as the block's one ``index_add_`` per expert does.

These paths implement it:

- :func:`torch_fused_moe`: one expert at a time over the rows routed to it, two matmuls each; the
  reference the kernel must match (and server/worker/moe.py's own loop, the CPU path);
- :mod:`kvscale.kernels.moe_triton`: the pairs sorted by expert and padded into blocks of rows
  of one expert (:func:`align_by_block`), then one grouped GEMM launch for gate|up with the gated
  SiLU in its epilogue and one for down with the routing weight, each program a tile of one
  expert's rows by output columns; the path on CUDA, without a read-back to the host.

Importing this module does not import Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvscale.kernels import use_triton
from kvscale.kernels.layer_ops import torch_silu_and_mul


@dataclass
class ExpertWeights:
    """Every expert's gate|up ``[2 * inter, hidden]`` and down ``[hidden, inter]``, by expert."""

    gate_up: tuple[Tensor, ...]
    down: tuple[Tensor, ...]
    # The kernel's per-expert addresses ([2, experts] int64: gate|up's, down's) on the weights'
    # device, made on its first launch (kvscale.kernels.moe_triton) and kept with these weights.
    table: Tensor | None = field(default=None, repr=False)
    first: tuple[int, int] = field(init=False, repr=False)  # expert 0's addresses when planned

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    @property
    def intermediate(self) -> int:
        return self.down[0].shape[1]

    def current(self, gate_up0: Tensor, down0: Tensor) -> bool:
        """Whether these are still the weights a module holds, given its first expert's: the same
        tensors at the same addresses (a module moved or reloaded by assignment must replan)."""
        return (gate_up0 is self.gate_up[0] and down0 is self.down[0]
                and (gate_up0.data_ptr(), down0.data_ptr()) == self.first)

    def __post_init__(self) -> None:
        if not self.gate_up or len(self.gate_up) != len(self.down):
            raise ValueError(f"{len(self.gate_up)} experts' gate|up weights for {len(self.down)} down weights")
        self.first = (self.gate_up[0].data_ptr(), self.down[0].data_ptr())


def check_routing(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor) -> None:
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"x {tuple(x.shape)} needs [tokens, k] routing, got ids {tuple(topk_ids.shape)} "
                         f"and weights {tuple(topk_weights.shape)}")
    if topk_ids.shape[1] > weights.num_experts:
        raise ValueError(f"top-{topk_ids.shape[1]} of {weights.num_experts} experts")


def torch_fused_moe(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """The contract in PyTorch: each expert's rows gathered, run, weighted and added back in
    ascending expert order (the per-expert loop of server/worker/moe.py)."""
    check_routing(x, weights, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten().long()
    order = flat.argsort(stable=True)
    rows_of = order // top_k
    weight_of = topk_weights.flatten().index_select(0, order)
    counts = torch.bincount(flat, minlength=weights.num_experts).tolist()
    out = torch.zeros_like(x)
    start = 0
    for gate_up, down, count in zip(weights.gate_up, weights.down, counts, strict=True):
        if count:
            rows = rows_of[start:start + count]
            act = torch_silu_and_mul(F.linear(x.index_select(0, rows), gate_up))
            out.index_add_(0, rows, (F.linear(act, down) * weight_of[start:start + count, None]).to(x.dtype))
        start += count
    return out


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block of one expert (``tl.dot`` takes at least 16): as few as a decode step's
    handful of rows per expert needs, more where each expert's rows fill bigger tiles, so that
    a weight tile read once serves more rows."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


@dataclass(frozen=True)
class BlockPlan:
    """The (token, slot) pairs by expert, on the device, as the kernel reads them."""

    pairs: Tensor  # int32 [max_blocks * rows]: pair ids (token * k + slot), each expert's padded
    block_experts: Tensor  # int32 [max_blocks]: each block's expert
    num_padded: Tensor  # int32 [1]: the rows the blocks in use hold; the grid's later blocks exit
    rows: int  # rows per block


def align_by_block(topk_ids: Tensor, num_experts: int, rows: int) -> BlockPlan:
    """Sort the pairs by expert (ascending pair id within one) and pad each expert's to a multiple
    of ``rows`` with the sentinel ``pairs`` (one past the last). On the device, read back nowhere:
    the grid is sized by the most blocks any routing could need, ``ceil(pairs / rows)`` plus one
    per expert present, and the blocks past ``num_padded`` do nothing."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    # scatter_add_, not bincount: bincount on CUDA reads the largest id back to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_ends = ((counts + rows - 1) // rows * rows).cumsum(0)
    order = flat.argsort(stable=True)
    expert_of = flat.index_select(0, order)
    # Each sorted pair's place: its expert's padded start plus its rank among that expert's pairs.
    starts = padded_ends - (counts + rows - 1) // rows * rows
    firsts = counts.cumsum(0) - counts
    position = starts.index_select(0, expert_of) + torch.arange(num_pairs, device=flat.device) \
        - firsts.index_select(0, expert_of)
    max_blocks = -(-num_pairs // rows) + min(num_experts, num_pairs)
    pairs = torch.full((max_blocks * rows,), num_pairs, dtype=torch.int32, device=flat.device)
    pairs.index_copy_(0, position, order.to(torch.int32))
    block_starts = torch.arange(max_blocks, device=flat.device) * rows
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return BlockPlan(pairs, block_experts.to(torch.int32), padded_ends[-1:].to(torch.int32), rows)


def sum_by_expert(contributions: Tensor) -> Tensor:
    """Each token's k contributions ``[tokens, k, hidden]`` (slots in ascending expert order)
    summed in their dtype one slot at a time, as the reference's ``index_add_`` adds them."""
    out = contributions[:, 0].clone()
    for j in range(1, contributions.shape[1]):
        out += contributions[:, j]
    return out


def moe_path(device: torch.device) -> str:
    """Which path runs the experts for tensors on ``device``: "triton" (CUDA, or forced as
    :func:`kvscale.kernels.use_triton` says) or "torch"."""
    return "triton" if use_triton(device) else "torch"


def fused_moe(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor) -> Tensor | None:
    """The contract in two Triton launches where ``x``'s device runs Triton and the tensors fit
    the kernel; None otherwise (the caller runs its own loop)."""
    if moe_path(x.device) != "triton":
        return None
    from kvscale.kernels import moe_triton

    return moe_triton.fused_moe(x, weights, topk_weights, topk_ids)


__all__ = ["BlockPlan", "ExpertWeights", "align_by_block", "block_rows", "check_routing", "fused_moe",
           "moe_path", "sum_by_expert", "torch_fused_moe"]
