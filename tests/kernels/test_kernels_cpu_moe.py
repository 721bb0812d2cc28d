"""The CPU experts kernel (kernels/moe_cpu.py, cpu_moe.c) against the contract's PyTorch reference
(kernels/moe.py): float32 to float32's rounding, bfloat16 no further from the exact block than the
reference is; experts with more pairs than a tile, with none, sizes off the kernel's blocks; and
the portable loops (a build without the CPU's bf16 dot products) against the native ones."""

from __future__ import annotations

import ctypes
import shutil
from importlib import resources

import pytest
import torch

from kvscale.kernels import cpu_build, cpu_prototypes
from kvscale.kernels.moe import ExpertWeights, torch_fused_moe
from kvscale.kernels.moe_cpu import moe_block, native_available


def case(tokens: int, hidden: int, inter: int, experts: int, k: int, dtype: torch.dtype, seed: int = 0):
    """Rows, stacked weights and a routing with each row's k distinct experts; expert 1 gets none."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 1] = -1.0
    topk_weights, topk_ids = torch.softmax(scores * 4, dim=-1).topk(k, dim=-1)
    return x, w13, w2, topk_weights.to(dtype), topk_ids


def through(call, x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The block's call (server/worker/moe.py): the routing as the router gives it."""
    return call(x, topk_ids, topk_weights, w13, w2)


def reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    return torch_fused_moe(x, ExpertWeights(tuple(w13), tuple(w2)), topk_weights, topk_ids)


SHAPES = [(1, 64, 32, 4, 2), (37, 96, 40, 6, 3), (70, 100, 24, 3, 1)]  # one row; tiles of 16; tails


@pytest.mark.parametrize("shape", SHAPES, ids=["one-row", "tiled", "tails"])
def test_float32_is_the_references_result(shape):
    assert native_available()
    args = case(*shape, torch.float32)
    torch.testing.assert_close(through(moe_block, *args), reference(*args))


@pytest.mark.parametrize("shape", SHAPES, ids=["one-row", "tiled", "tails"])
def test_bfloat16_is_no_further_from_the_exact_block_than_the_reference(shape):
    args = case(*shape, torch.bfloat16)
    exact = reference(*(a.double() if a.is_floating_point() else a for a in args))
    ours = (through(moe_block, *args).double() - exact).abs()
    theirs = (reference(*args).double() - exact).abs()
    assert ours.mean() <= 1.1 * theirs.mean(), (ours.mean(), theirs.mean())
    assert ours.max() <= 1.5 * theirs.max(), (ours.max(), theirs.max())


@pytest.fixture(scope="module")
def portable_moe(tmp_path_factory: pytest.TempPathFactory):
    """cpu_moe.c built again without AVX-512 BF16: the portable loops every other CPU runs."""
    compiler = shutil.which("cc")
    assert compiler is not None
    directory = tmp_path_factory.mktemp("portable_moe")
    source = directory / "cpu_moe.c"
    source.write_bytes(resources.files("kvscale.kernels").joinpath("cpu_moe.c").read_bytes())
    built = directory / "moe.so"
    cpu_build._run_compiler([compiler, *cpu_build.CFLAGS, "-mno-avx512bf16", "-c", "-o", str(directory / "moe.o"),
                             str(source)])
    cpu_build._run_compiler([compiler, *cpu_build.LDFLAGS, "-o", str(built), str(directory / "moe.o"),
                             *cpu_build.LDLIBS])
    lib = ctypes.CDLL(str(built))
    restype, argtypes = cpu_prototypes.C_PROTOTYPES["kvscale_moe_block"]
    lib.kvscale_moe_block.restype, lib.kvscale_moe_block.argtypes = restype, argtypes

    def call(x, topk_ids, topk_weights, w13, w2):
        out = torch.empty_like(x)
        weights = topk_weights.float().contiguous()
        status = lib.kvscale_moe_block(
            x.data_ptr(), x.stride(0), topk_ids.data_ptr(), weights.data_ptr(), x.shape[0], topk_ids.shape[1],
            w13.shape[0], w13.data_ptr(), w2.data_ptr(), x.shape[1], w2.shape[2], out.data_ptr(),
            int(x.dtype == torch.bfloat16), torch.get_num_threads())
        assert status == 0
        return out

    return call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_loops_give_the_native_ones_result(portable_moe, dtype):
    args = case(37, 96, 40, 6, 3, dtype)
    torch.testing.assert_close(through(portable_moe, *args), through(moe_block, *args))
