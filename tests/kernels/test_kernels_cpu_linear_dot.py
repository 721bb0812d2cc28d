"""The bf16 dot-product projection (cpu_linear_dot.c) against float32 matrix products of the same
bf16 inputs, its rows independent of one another, and its fused SiLU-and-multiply against the two ops."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels import cpu_build, cpu_native
from kvscale.server.worker.cpu_features import cpu_features

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")


def _cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_features().flags


dot = pytest.mark.skipif(not _cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16 dot products")


def test_the_dot_path_is_there_exactly_where_the_cpu_has_bf16_dot_products() -> None:
    assert cpu_native.dot_linear_available() == _cpu_has_avx512_bf16()


def _case(rows: int, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen)
    # A column slice of wider rows, as the fused projections' outputs are read.
    wide = torch.randn(rows, in_features + 32, generator=gen).to(torch.bfloat16)
    return weight, bias, wide[:, 16:16 + in_features]


@dot
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 40])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (192, 98), (128, 1536)])
def test_the_projection_is_the_bf16_product(rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    weight, bias, x = _case(rows, out_features, in_features, rows * out_features + in_features)
    packed = cpu_native.pack_linear_dot(weight)
    assert packed is not None
    got = cpu_native.linear_dot(x, packed, bias if with_bias else None, out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    expected = x.float() @ weight.float().t() + (bias if with_bias else 0)
    # One rounding to bfloat16 of a float32 sum: half a unit in the last place, and the sums'
    # order (a few float32 ulps) besides.
    assert ((got.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all()


@dot
@pytest.mark.parametrize("rows", [2, 5, 6, 13])
def test_a_row_comes_out_the_same_alone_or_with_others(rows: int) -> None:
    """Each (row, column) sum runs over k in the same order whatever the call's other rows: a
    speculative verify step's rows are each a one-row decode step's bits."""
    weight, bias, x = _case(rows, 192, 576, rows)
    packed = cpu_native.pack_linear_dot(weight)
    assert packed is not None
    batched = cpu_native.linear_dot(x, packed, bias, 192)
    alone = torch.cat([cpu_native.linear_dot(x[r:r + 1], packed, bias, 192) for r in range(rows)])
    assert torch.equal(batched, alone)


@dot
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_silu_mul_is_the_same_bits_as_the_projection_then_the_op(rows: int) -> None:
    weight, bias, x = _case(rows, 256, 128, 100 + rows)
    packed = cpu_native.pack_linear_dot(weight)
    assert packed is not None
    assert cpu_native.dot_silu_mul_fits(256) and not cpu_native.dot_silu_mul_fits(192)
    fused = cpu_native.linear_dot(x, packed, bias, 256, silu_mul=True)
    assert fused.shape == (rows, 128)
    assert torch.equal(fused, cpu_native.silu_and_mul(cpu_native.linear_dot(x, packed, bias, 256)))


@dot
def test_leading_dimensions_are_kept() -> None:
    weight, _, _ = _case(1, 64, 64, 3)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    packed = cpu_native.pack_linear_dot(weight)
    assert packed is not None
    got = cpu_native.linear_dot(x, packed, None, 64)
    assert got.shape == (2, 3, 64)
    assert torch.equal(got.reshape(6, 64), cpu_native.linear_dot(x.reshape(6, 64), packed, None, 64))


@pytest.mark.parametrize(("shape", "dtype"), [((96, 64), torch.bfloat16), ((64, 41), torch.bfloat16),
                                              ((64, 64), torch.float32)], ids=["out-96", "in-odd", "float32"])
def test_what_the_kernel_cannot_run_is_left_to_onednn(shape: tuple[int, int], dtype: torch.dtype) -> None:
    assert cpu_native.pack_linear_dot(torch.zeros(shape, dtype=dtype)) is None


def test_without_the_c_kernels_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", "reference")
    cpu_build.library.cache_clear()
    cpu_native.dot_linear_available.cache_clear()
    assert cpu_native.pack_linear_dot(torch.zeros(64, 64, dtype=torch.bfloat16)) is None
