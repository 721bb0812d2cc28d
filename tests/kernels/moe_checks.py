"""Mixture-of-experts cases and the comparison of the Triton kernel (kernels/moe_triton.py) with its
PyTorch reference (kernels/moe.py's ``torch_fused_moe``).

Shared by the interpreter test (``test_kernels_moe_interpret.py`` runs this file as a child with
``TRITON_INTERPRET=1``), the CUDA test and ``bench/gpu_kernels.py --check`` (kernel_checks.py's
"moe" kernel, a random case each); ``bench/gpu_kernels_moe.py`` times the same block at a real
model's shape. ``python tests/kernels/moe_checks.py --device cpu`` prints one JSON line per case
and dtype and exits non-zero if any fails.

The fixed cases cover what the kernel's plan must get right: top-k 1, 2 and 4 (k equal to the
experts too), experts no token chose, one expert's rows over several blocks beside experts with
one row, widths that are not multiples of the kernel's tiles, and both routing-weight dtypes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from kvscale.kernels.moe import ExpertWeights, torch_fused_moe

# Relative to 1 + |expected|: the dots sum in other orders, so a rounded intermediate can differ
# by one unit in its last place and carry that through down; and Triton's interpreter rounds
# float32 to bfloat16 toward zero (every value it stores, each intermediate), where PyTorch and
# the GPU round to nearest.
MOE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class MoeShape:
    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    chosen: int  # experts the router may pick (the rest get no rows); ``experts`` for all
    skew: float = 0.0  # added to expert 0's logit: a ragged share, its rows over several blocks
    round_weights: bool = False  # routing weights in the model's dtype (Qwen3-MoE), else float32


CASES = [
    MoeShape(tokens=5, experts=4, top_k=1, hidden=48, inter=40, chosen=4),
    MoeShape(tokens=9, experts=8, top_k=2, hidden=32, inter=24, chosen=5, round_weights=True),
    MoeShape(tokens=7, experts=6, top_k=4, hidden=80, inter=72, chosen=6),
    MoeShape(tokens=37, experts=3, top_k=2, hidden=40, inter=24, chosen=3, skew=4.0, round_weights=True),
    MoeShape(tokens=6, experts=4, top_k=4, hidden=32, inter=40, chosen=4),
    MoeShape(tokens=1, experts=16, top_k=2, hidden=64, inter=32, chosen=16),
]


@dataclass
class MoeCase:
    x: Tensor
    weights: ExpertWeights
    topk_weights: Tensor
    topk_ids: Tensor

    def on(self, device: str | torch.device) -> MoeCase:
        return MoeCase(self.x.to(device), ExpertWeights(tuple(t.to(device) for t in self.weights.gate_up),
                                                        tuple(t.to(device) for t in self.weights.down)),
                       self.topk_weights.to(device), self.topk_ids.to(device))


def route(logits: Tensor, top_k: int, dtype: torch.dtype, round_weights: bool) -> tuple[Tensor, Tensor]:
    """server/worker/moe.py's routing: softmax in float32, top-k, renormalized."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(dtype) if round_weights else weights), ids


def make_moe_case(gen: torch.Generator, dtype: torch.dtype, shape: MoeShape) -> MoeCase:
    s = shape
    gate_up = tuple((torch.randn(2 * s.inter, s.hidden, generator=gen) * s.hidden**-0.5).to(dtype)
                    for _ in range(s.experts))
    down = tuple((torch.randn(s.hidden, s.inter, generator=gen) * s.inter**-0.5).to(dtype) for _ in range(s.experts))
    x = torch.randn(s.tokens, s.hidden, generator=gen).to(dtype)
    logits = torch.randn(s.tokens, s.experts, generator=gen)
    logits[:, s.chosen:] = -float("inf")  # experts past ``chosen`` receive no rows
    logits[:, 0] += s.skew
    topk_weights, topk_ids = route(logits, s.top_k, dtype, s.round_weights)
    if s.chosen < s.top_k:
        raise ValueError(f"{s}: fewer experts to choose than top-k")
    return MoeCase(x, ExpertWeights(gate_up, down), topk_weights, topk_ids)


def check_moe_case(gen: torch.Generator, dtype: torch.dtype, device: str, shape: MoeShape) -> dict:
    from kernel_checks import relative_error

    from kvscale.kernels import moe_triton

    case = make_moe_case(gen, dtype, shape)
    expected = torch_fused_moe(case.x, case.weights, case.topk_weights, case.topk_ids)
    dev = case.on(device)
    actual = moe_triton.fused_moe(dev.x, dev.weights, dev.topk_weights, dev.topk_ids)
    if actual is None:
        raise AssertionError(f"moe: the kernel declined the case {shape} {dtype}")
    counts = torch.bincount(case.topk_ids.flatten(), minlength=shape.experts).tolist()
    return {"kernel": "moe", "dtype": str(dtype).removeprefix("torch."), "tokens": shape.tokens,
            "experts": shape.experts, "top_k": shape.top_k, "hidden": shape.hidden, "inter": shape.inter,
            "rows_by_expert": counts, "round_weights": shape.round_weights,
            "max_error": relative_error(actual, expected), "tolerance": MOE_TOLERANCE[dtype]}


def check_moe(gen: torch.Generator, dtype: torch.dtype, device: str) -> dict:
    """One of the fixed cases, drawn by ``gen`` (kernel_checks.py's "moe" kernel)."""
    return check_moe_case(gen, dtype, device, CASES[int(torch.randint(len(CASES), (1,), generator=gen))])


def make_block(gen: torch.Generator, dtype: torch.dtype, top_k: int, round_weights: bool,
               experts: int = 6, hidden: int = 48, inter: int = 40) -> torch.nn.Module:
    """server/worker/moe.py's block with random weights in ``dtype``."""
    from kvscale.server.worker.moe import MoeSpec, SparseMoeBlock

    spec = MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=inter, norm_topk_prob=True,
                   round_weights=round_weights, layers=(0,))
    block = SparseMoeBlock(spec, hidden).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return block.to(dtype)


def check_block(gen: torch.Generator, dtype: torch.dtype, top_k: int) -> dict:
    """The block's forward where Triton runs (this process's ``KVSCALE_FORCE_TRITON``) against
    its own loop with Triton turned off: the kernel must be what ran, and agree."""
    import os

    from kvscale.kernels import moe_triton

    block = make_block(gen, dtype, top_k, round_weights=dtype != torch.float32)
    x = torch.randn(11, 48, generator=gen).to(dtype)
    calls = []
    launch = moe_triton.fused_moe

    def counted(*args: object) -> Tensor | None:
        calls.append(1)
        return launch(*args)  # type: ignore[arg-type]

    moe_triton.fused_moe = counted
    try:
        with torch.no_grad():
            fused = block(x)
            os.environ["KVSCALE_FORCE_TRITON"] = "0"
            loop = block(x)
    finally:
        moe_triton.fused_moe = launch
        os.environ["KVSCALE_FORCE_TRITON"] = "1"
    from kernel_checks import relative_error

    return {"kernel": "moe_block", "dtype": str(dtype).removeprefix("torch."), "top_k": top_k,
            "kernel_calls": len(calls), "max_error": relative_error(fused, loop), "tolerance": MOE_TOLERANCE[dtype]}


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block", action="store_true",
                        help="also server/worker/moe.py's block through the kernel against its loop (CPU, forced Triton)")
    args = parser.parse_args(argv)
    ok = True
    for name in args.dtype or ["float32"]:
        gen = torch.Generator().manual_seed(args.seed)
        for shape in CASES:
            result = check_moe_case(gen, DTYPES[name], args.device, shape)
            result["ok"] = result["max_error"] <= result["tolerance"]
            ok &= result["ok"]
            print(json.dumps(result), flush=True)
        for top_k in (1, 2) if args.block else ():
            result = check_block(gen, DTYPES[name], top_k)
            result["ok"] = result["max_error"] <= result["tolerance"] and result["kernel_calls"] == 1
            ok &= result["ok"]
            print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
