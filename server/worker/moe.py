"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE): a router picks each row's experts,
each expert a gated MLP, their outputs summed with the router's weights.

Computed in torch, one expert at a time over the rows routed to it: the batch's (row, expert)
pairs sorted by expert, each expert's rows gathered, run through its gate|up and down
projections, scaled and added back into their rows. A row's result depends on its own router
output alone, so prefill and decode rows mix freely in a batch. Each expert's projections are
``nn.Linear`` modules like the dense MLP's (gate|up fused at load), so the CPU's weight layouts
(server/worker/cpu_linear.py) apply to them unchanged. The expert counts are read back to the
host once per layer to size those gathers, which is why a CUDA graph cannot hold this block
(server/worker/decode_graphs.py). Where Triton runs (CUDA, or ``KVSCALE_FORCE_TRITON``), the
fused kernel of kernels/moe_triton.py computes the same block in two launches instead.

On the CPU where the C kernels build, the experts run in one call per layer (kernels/moe_cpu.py,
the same contract): :func:`stack_cpu_experts` stacks each block's expert matrices once at load
(the experts' ``nn.Linear`` weights become views of the stacks, left in their plain layout), and
the kernel reads each expert's matrices once for all its pairs, up to :func:`stacked_pays`'s
pairs per expert (a long prefill chunk's many run the loop, on those plain weights). The loop
made some 250 PyTorch calls per layer on a 16-row decode step, whose rows reach most experts
with one or two rows each; their dispatch, not the multiply-adds, was the step's time
(docs/performance.md, "At a glance", MoE decode).

Numerics follow transformers: the router's logits in the model's dtype, softmax in float32, the
top-k, renormalized where the family does; the experts added in ascending order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from kvscale.kernels import layer_ops, moe_cpu
from kvscale.kernels import moe as fused_moe

# The most (row, expert) pairs per expert, on average over the block's experts, that the CPU's C
# kernel takes; past them the per-expert loop's GEMMs (oneDNN's blocked kernels) are the faster.
# One block of 32 experts, top-4, 512 wide, expert intermediate 256, 2 threads, Zen 5 EPYC
# (AVX-512 BF16), kernel ÷ loop on plain weights: bfloat16 0.16 at 2 pairs per expert, 0.57 at
# 16, 1.01 at 32, 1.31 at 64; float32 0.14 at 2, 0.56 at 32, 0.90 at 128 (the loop's float32
# GEMM is MKL's generic path on this CPU: server/worker/cpu_linear.py).
STACKED_PAIRS_PER_EXPERT_MAX = {torch.bfloat16: 32, torch.float32: 128}


def stacked_pays(rows: int, top_k: int, num_experts: int, dtype: torch.dtype) -> bool:
    """Whether a block's ``rows`` run in the C kernel rather than the per-expert loop: a decode
    step's few pairs per expert always, a long prefill chunk's many not (see the limits above)."""
    return rows * top_k <= STACKED_PAIRS_PER_EXPERT_MAX.get(dtype, 0) * num_experts


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    # Whether the top-k probabilities are rescaled to sum to one (always in Mixtral).
    norm_topk_prob: bool
    # Whether the routing weights are rounded to the model's dtype before they scale an expert's
    # output (Qwen3-MoE); Mixtral scales in float32 and rounds the product.
    round_weights: bool
    # The layers whose MLP is this block; the others keep the dense MLP.
    layers: tuple[int, ...]
    # How the family's checkpoints name the block and each expert's gate, up and down projections.
    checkpoint_block: str = "mlp"
    checkpoint_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


def check_moe_spec(moe: MoeSpec) -> None:
    """Refuse a routing no forward could run, before anything is allocated."""
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(f"a mixture of {moe.num_experts} experts cannot route each token to {moe.top_k}")


class Expert(nn.Module):
    """One expert: SiLU-gated MLP without biases, its gate and up projections fused."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.projected_silu_and_mul(self.gate_up_proj, x))


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeSpec, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(hidden_size, moe.intermediate_size) for _ in range(moe.num_experts))
        self.expert_weights: fused_moe.ExpertWeights | None = None  # the fused kernel's, on first use
        # The experts' gate|up [experts, 2I, hidden] and down [experts, hidden, I] matrices, once
        # stack_experts has made them (the CPU's C kernel's operands); None: the per-expert loop.
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def stack_experts(self) -> bool:
        """Stack the experts' matrices for the CPU's C kernel, each expert's ``nn.Linear`` weights
        then views of the stacks (no second copy); whether it did: plain bias-free experts of a
        dtype the kernel takes, on the CPU, where the C kernels build."""
        if not moe_cpu.native_available() or not all(type(e) is Expert for e in self.experts):
            return False
        projections = [(e.gate_up_proj, e.down_proj) for e in cast("list[Expert]", list(self.experts))]
        if not all(type(g) is nn.Linear and type(d) is nn.Linear and g.bias is None and d.bias is None
                   for g, d in projections):
            return False
        weight = projections[0][0].weight
        if not weight.is_cpu or weight.dtype not in moe_cpu.DTYPES:
            return False
        self.w13 = torch.stack([g.weight.detach() for g, _ in projections])
        self.w2 = torch.stack([d.weight.detach() for _, d in projections])
        for e, (g, d) in enumerate(projections):
            g.weight.data, d.weight.data = self.w13[e], self.w2[e]
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's routing weights and experts, ``[rows, top_k]`` each."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.moe.round_weights:
            weights = weights.to(x.dtype)
        return weights, experts

    def fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """The block in the fused kernel where ``x``'s device runs Triton and the experts' weights
        fit it; None elsewhere."""
        if fused_moe.moe_path(x.device) != "triton":
            return None
        experts_ = cast("list[Expert]", list(self.experts))
        gate_up0, down0 = getattr(experts_[0].gate_up_proj, "weight", None), getattr(experts_[0].down_proj, "weight", None)
        if not isinstance(gate_up0, torch.Tensor) or not isinstance(down0, torch.Tensor):
            return None  # projections replaced by other layouts
        if self.expert_weights is None or not self.expert_weights.current(gate_up0, down0):
            self.expert_weights = fused_moe.ExpertWeights(tuple(e.gate_up_proj.weight for e in experts_),
                                                          tuple(e.down_proj.weight for e in experts_))
        return fused_moe.fused_moe(x, self.expert_weights, weights, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if (out := self.fused(x, weights, experts)) is not None:
            return out
        if (self.w13 is not None and self.w2 is not None and x.is_cpu and x.dtype == self.w13.dtype
                and stacked_pays(x.shape[0], self.moe.top_k, self.moe.num_experts, x.dtype)):
            return self._forward_stacked(x, weights, experts)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        rows_of = order // self.moe.top_k  # the row of each (row, expert) pair, grouped by expert
        weight_of = weights.flatten().index_select(0, order)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = rows_of[start:start + count]
                scaled = expert(x.index_select(0, rows)) * weight_of[start:start + count, None]
                out.index_add_(0, rows, scaled.to(x.dtype))
            start += count
        return out

    def _forward_stacked(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The loop's result from one C call: the pairs grouped by expert, each scaled by its
        weight, each row's summed in ascending expert order in the model's dtype (kernels/moe.py's
        contract)."""
        assert self.w13 is not None and self.w2 is not None
        return moe_cpu.moe_block(x.contiguous(), experts, weights, self.w13, self.w2)


def stack_cpu_experts(model: nn.Module) -> set[int]:
    """Stack the experts of every plain :class:`SparseMoeBlock` of a CPU model for the C kernel;
    the ids of the ``nn.Linear`` modules it left plain (their weights are the stacks' views: a
    layout of their own would copy them)."""
    plain: set[int] = set()
    for block in model.modules():
        if type(block) is SparseMoeBlock and block.stack_experts():
            plain.update(id(m) for e in block.experts for m in (e.gate_up_proj, e.down_proj))
    return plain


def moe_weights(take: Callable[[str], torch.Tensor], names: Mapping[str, object], prefix: str,
                moe: MoeSpec) -> dict[str, torch.Tensor]:
    """Layer ``prefix``'s block (``model.layers.{i}.``) from a checkpoint, named as
    :class:`SparseMoeBlock` names it under ``mlp.``: the family's per-expert projections, or the
    stacked ``[experts, ...]`` tensors transformers writes without its original format (gate|up
    already fused in that order). ``take`` fetches a checkpoint tensor and marks it used."""
    block = f"{prefix}{moe.checkpoint_block}."
    stacked = f"{prefix}mlp.experts."
    if stacked + "gate_up_proj" in names:  # transformers renames the block to mlp. in this form
        gate_up, down = take(stacked + "gate_up_proj"), take(stacked + "down_proj")
        if gate_up.shape[0] != moe.num_experts or down.shape[0] != moe.num_experts:
            raise ValueError(f"checkpoint layer {prefix!r} stacks {gate_up.shape[0]} experts, the config "
                             f"names {moe.num_experts}")
        loaded = {"mlp.gate.weight": take(f"{prefix}mlp.gate.weight")}
        for e in range(moe.num_experts):
            loaded[f"mlp.experts.{e}.gate_up_proj.weight"] = gate_up[e]
            loaded[f"mlp.experts.{e}.down_proj.weight"] = down[e]
        return loaded
    loaded = {"mlp.gate.weight": take(block + "gate.weight")}
    gate, up, down_name = moe.checkpoint_experts
    for e in range(moe.num_experts):
        expert = f"{block}experts.{e}."
        loaded[f"mlp.experts.{e}.gate_up_proj.weight"] = torch.cat(
            [take(f"{expert}{gate}.weight"), take(f"{expert}{up}.weight")])
        loaded[f"mlp.experts.{e}.down_proj.weight"] = take(f"{expert}{down_name}.weight")
    return loaded
