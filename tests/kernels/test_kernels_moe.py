"""The fused mixture-of-experts contract on the CPU (kernels/moe.py): its PyTorch reference equal
to server/worker/moe.py's own loop, the pairs' plan by expert, the sum's order, which path runs
where; and the kernel compiled for an H100 ahead of time (as test_kernels_compile_sm90.py does).
The kernel's arithmetic is checked in test_kernels_moe_interpret.py."""

from __future__ import annotations

import pytest
import torch
from moe_checks import make_block, route

from kvscale.kernels.moe import (
    ExpertWeights,
    align_by_block,
    block_rows,
    moe_path,
    sum_by_expert,
    torch_fused_moe,
)


def weights_of(block: torch.nn.Module) -> ExpertWeights:
    return ExpertWeights(tuple(e.gate_up_proj.weight for e in block.experts),
                         tuple(e.down_proj.weight for e in block.experts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_reference_equals_the_blocks_loop(dtype: torch.dtype, top_k: int) -> None:
    gen = torch.Generator().manual_seed(top_k)
    block = make_block(gen, dtype, top_k, round_weights=top_k == 2)
    x = torch.randn(13, 48, generator=gen).to(dtype)
    with torch.no_grad():
        expected = block(x)
        actual = torch_fused_moe(x, weights_of(block), *block.route(x))
    # The same per-expert matmuls and sums; SiLU-and-multiply may be the CPU's C kernel in the
    # block, whose exp rounds its last bit its own way.
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert float(((actual.double() - expected.double()).abs() / (1 + expected.double().abs())).max()) <= tolerance


@pytest.mark.parametrize("experts,top_k,tokens,rows", [(4, 1, 5, 16), (8, 2, 9, 16), (3, 2, 37, 16), (4, 4, 6, 32),
                                                      (128, 8, 1, 16), (16, 1, 16, 16), (2, 2, 70, 64)])
def test_align_by_block_places_every_pair_once_in_its_experts_blocks(experts: int, top_k: int, tokens: int,
                                                                     rows: int) -> None:
    gen = torch.Generator().manual_seed(experts * 100 + tokens)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, experts // 2:] -= 3 * (experts > 4)  # many experts: most pairs on half of them, some on none
    _, ids = route(logits, top_k, torch.float32, False)
    if experts == 16:
        ids = torch.arange(16).view(16, 1)  # every expert one row: the most blocks a routing needs
    plan = align_by_block(ids, experts, rows)
    flat, num_pairs = ids.flatten(), tokens * top_k
    counts = torch.bincount(flat, minlength=experts)
    padded = int(((counts + rows - 1) // rows * rows).sum())
    assert plan.rows == rows and plan.num_padded.tolist() == [padded]
    pairs = plan.pairs.tolist()
    assert len(pairs) >= padded and set(pairs[padded:]) <= {num_pairs}  # only the sentinel past the blocks in use
    used = [p for p in pairs[:padded] if p < num_pairs]
    assert sorted(used) == list(range(num_pairs))
    for b in range(padded // rows):
        block = [p for p in pairs[b * rows:(b + 1) * rows] if p < num_pairs]
        assert block, "a block in use holds at least one pair"
        assert block == sorted(block) and all(int(flat[p]) == int(plan.block_experts[b]) for p in block)
    # Experts in ascending order, none that no token chose.
    block_experts = plan.block_experts[:padded // rows].tolist()
    assert block_experts == sorted(block_experts)
    assert set(block_experts) == {e for e in range(experts) if counts[e]}


def test_block_rows_grow_with_each_experts_rows() -> None:
    assert block_rows(1 * 8, 128) == 16  # a decode token of Qwen3-30B-A3B
    assert block_rows(256 * 8, 128) == 16
    assert block_rows(512 * 8, 128) == 32
    assert block_rows(2048 * 8, 128) == 64


def test_sum_by_expert_adds_slot_by_slot_in_the_dtype() -> None:
    c = torch.tensor([[[1.0], [2**-8], [2**-8]]], dtype=torch.bfloat16)
    # bfloat16 keeps 8 significant bits: 1 + 2**-8 is a tie that rounds to 1; 2**-7 does not.
    assert sum_by_expert(c).tolist() == [[1.0]]
    assert sum_by_expert(c.flip(1)).tolist() == [[1.0078125]]


def test_the_kernel_runs_on_cuda_or_forced_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_FORCE_TRITON", raising=False)
    assert moe_path(torch.device("cpu")) == "torch" and moe_path(torch.device("cuda")) == "triton"
    block = make_block(torch.Generator().manual_seed(0), torch.float32, 2, False)
    x = torch.randn(3, 48)
    assert block.fused(x, *block.route(x)) is None and block.expert_weights is None  # the CPU loop, untouched
    monkeypatch.setenv("KVSCALE_FORCE_TRITON", "1")
    assert moe_path(torch.device("cpu")) == "triton"


def test_expert_weights_are_replanned_when_the_module_holds_others() -> None:
    block = make_block(torch.Generator().manual_seed(0), torch.float32, 2, False)
    first = block.experts[0]
    weights = weights_of(block)
    assert weights.current(first.gate_up_proj.weight, first.down_proj.weight)
    first.down_proj.weight = torch.nn.Parameter(first.down_proj.weight.clone())  # reloaded by assignment
    assert not weights.current(first.gate_up_proj.weight, first.down_proj.weight)
    weights = weights_of(block)
    first.gate_up_proj.weight.data = first.gate_up_proj.weight.data.clone()  # moved, as Module.to does
    assert not weights.current(first.gate_up_proj.weight, first.down_proj.weight)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_moe_kernel_compiles_to_sm90_cubin(dtype: str) -> None:
    import triton.language as tl
    from test_kernels_compile_sm90 import compile_for_h100

    from kvscale.kernels.moe_triton import BLOCK_K, BLOCK_N, _expert_gemm_kernel

    dot = {"DOT_DTYPE": tl.bfloat16 if dtype == "bf16" else tl.float32,
           "DOT_PRECISION": "tf32" if dtype == "bf16" else "ieee"}
    pointers = {"a_ptr": "*" + dtype, "out_ptr": "*" + dtype, "scale_ptr": "*fp32", "table_ptr": "*i64",
                "pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_padded_ptr": "*i32"}
    for gated, rows in ((True, 16), (False, 64)):
        kernel = compile_for_h100(_expert_gemm_kernel, pointers, {
            "TOP_K": 8 if gated else 1, "GATED": gated, "BLOCK_M": rows, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K,
            **dot})
        assert kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]
        assert kernel.metadata.shared <= 227 * 1024
