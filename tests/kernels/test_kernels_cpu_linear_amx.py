"""The AMX projection (cpu_linear_amx.c) against float32 matrix products of the same bf16 inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import cpu_has_amx_bf16

from kvscale.kernels import cpu_build, cpu_native

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")


amx = pytest.mark.skipif(not cpu_has_amx_bf16(), reason="this CPU has no AMX bf16 tiles")


def test_the_amx_path_is_there_exactly_where_the_cpu_has_amx() -> None:
    assert cpu_native.amx_linear_available() == cpu_has_amx_bf16()


def _bf16_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    expected = x.float() @ weight.float().t()
    return expected if bias is None else expected + bias


@amx
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 64, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (64, 160)])
def test_the_projection_is_the_bf16_product(rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    # A column slice of wider rows, as the fused projections' outputs are read.
    wide = torch.randn(rows, in_features + 32, generator=gen).to(torch.bfloat16)
    x = wide[:, 16:16 + in_features]
    packed = cpu_native.pack_linear_amx(weight)
    assert packed is not None
    got = cpu_native.linear_amx(x, packed, bias, out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    expected = _bf16_product(x, weight, bias)
    # One rounding to bfloat16 of a float32 sum: half a unit in the last place, and the sums'
    # order (a few float32 ulps) besides.
    assert ((got.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all()


@amx
def test_leading_dimensions_are_kept() -> None:
    weight = torch.randn(32, 64).to(torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    packed = cpu_native.pack_linear_amx(weight)
    assert packed is not None
    got = cpu_native.linear_amx(x, packed, None, 32)
    assert got.shape == (2, 3, 32)
    expected = _bf16_product(x.reshape(6, 64), weight, None).reshape(2, 3, 32)
    assert ((got.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all()


@pytest.mark.parametrize(("shape", "dtype"), [((48, 64), torch.bfloat16), ((64, 40), torch.bfloat16),
                                              ((64, 64), torch.float32)], ids=["out-48", "in-40", "float32"])
def test_what_the_kernel_cannot_run_is_left_to_onednn(shape: tuple[int, int], dtype: torch.dtype) -> None:
    assert cpu_native.pack_linear_amx(torch.zeros(shape, dtype=dtype)) is None


def test_without_the_c_kernels_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", "reference")
    cpu_build.library.cache_clear()
    cpu_native.amx_linear_available.cache_clear()
    assert cpu_native.pack_linear_amx(torch.zeros(64, 64, dtype=torch.bfloat16)) is None


def _int8_case(rows: int, out_features: int, in_features: int, with_bias: bool):
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    xq = torch.randint(0, 256, (rows, in_features), generator=gen, dtype=torch.uint8)
    x_scales = torch.rand(rows, generator=gen) * 0.01 + 1e-4
    w_scales = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    sums = (xq.long() - 128) @ weight.long().t()  # exact
    expected = sums.double() * w_scales.double() * x_scales.double()[:, None]
    if bias is not None:
        expected += bias.double()
    return weight, xq, x_scales, w_scales, bias, expected


@amx
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 64, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (64, 192)])
def test_the_int8_projection_is_the_exact_integer_product_rescaled(
        rows: int, out_features: int, in_features: int, with_bias: bool, out_dtype: torch.dtype) -> None:
    weight, xq, x_scales, w_scales, bias, expected = _int8_case(rows, out_features, in_features, with_bias)
    packed = cpu_native.pack_linear_amx_int8(weight)
    assert packed is not None
    assert torch.equal(packed[1], weight.int().sum(dim=1, dtype=torch.int32))
    got = cpu_native.linear_amx_int8(xq, x_scales, packed, w_scales, bias, out_dtype)
    assert got.dtype == out_dtype and got.shape == (rows, out_features)
    # The sums are exact; what is left is float32's (or bfloat16's) rounding of the rescale.
    relative = 2**-20 if out_dtype == torch.float32 else 2**-8
    assert ((got.double() - expected).abs() <= expected.abs() * relative + 1e-6).all()


@pytest.mark.parametrize(("shape", "dtype"), [((48, 64), torch.int8), ((64, 96), torch.int8),
                                              ((64, 64), torch.uint8)], ids=["out-48", "in-96", "uint8"])
def test_what_the_int8_kernel_cannot_run_is_left_to_onednn(shape: tuple[int, int], dtype: torch.dtype) -> None:
    assert cpu_native.pack_linear_amx_int8(torch.zeros(shape, dtype=dtype)) is None


@amx
def test_the_int8_projection_takes_strided_activations() -> None:
    weight, xq, x_scales, w_scales, bias, expected = _int8_case(33, 64, 192, True)
    packed = cpu_native.pack_linear_amx_int8(weight)
    assert packed is not None
    wide = torch.full((33, 256), 7, dtype=torch.uint8)
    wide[:, 32:224] = xq
    got = cpu_native.linear_amx_int8(wide[:, 32:224], x_scales, packed, w_scales, bias, torch.float32)
    assert ((got.double() - expected).abs() <= expected.abs() * 2**-20 + 1e-6).all()


@amx
@pytest.mark.parametrize("rows", [33, 48, 49, 64, 100])
def test_a_row_comes_out_the_same_alone_or_in_a_batch(rows: int) -> None:
    """Batches of 33-64 rows take both 32-row passes in turns over chunks of k, their sums parked
    between turns (block_product_pair); a row alone takes one pass. Parking float32 or int32 sums
    loses nothing, so each row's output is the same bits either way, over k of several chunks."""
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 576, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    packed = cpu_native.pack_linear_amx(weight)
    assert packed is not None
    batched = cpu_native.linear_amx(x, packed, bias, 96)
    alone = torch.cat([cpu_native.linear_amx(x[r:r + 1], packed, bias, 96) for r in range(rows)])
    assert torch.equal(batched, alone)

    int8_weight, xq, x_scales, w_scales, _, _ = _int8_case(rows, 64, 320, False)
    int8_packed = cpu_native.pack_linear_amx_int8(int8_weight)
    assert int8_packed is not None
    batched = cpu_native.linear_amx_int8(xq, x_scales, int8_packed, w_scales, bias[:64], torch.float32)
    alone = torch.cat([cpu_native.linear_amx_int8(xq[r:r + 1], x_scales[r:r + 1], int8_packed, w_scales, bias[:64],
                                                  torch.float32) for r in range(rows)])
    assert torch.equal(batched, alone)


def _gate_up_activations(rows: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """Ordinary activations and a few huge ones, so that some gate values leave expf's vector
    range (|gate| > 87) and take the kernel's scalar path."""
    x = torch.randn(rows, in_features, generator=gen) * 3
    return torch.where(torch.rand(rows, in_features, generator=gen) < 0.02, x * 400, x)


@amx
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 7, 17, 33, 64, 300])
def test_silu_and_mul_as_the_projection_stores_is_the_two_ops_bit_for_bit(rows: int, with_bias: bool) -> None:
    """The gate|up projection with SiLU-and-multiply applied as it stores its rows gives exactly
    the bits of the projection followed by the layer op, huge gates (expf's scalar path) included."""
    gen = torch.Generator().manual_seed(rows)
    out_features, in_features = 192, 96
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.2).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen) * 3 if with_bias else None
    x = _gate_up_activations(rows, in_features, gen).to(torch.bfloat16)
    packed = cpu_native.pack_linear_amx(weight)
    assert packed is not None
    two_ops = cpu_native.silu_and_mul(cpu_native.linear_amx(x, packed, bias, out_features))
    fused = cpu_native.linear_amx(x, packed, bias, out_features, silu_mul=True)
    assert two_ops is not None and fused.shape == (rows, out_features // 2)
    assert torch.equal(fused.view(torch.int16), two_ops.view(torch.int16))


@amx
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 17, 64, 300])
def test_the_int8_projection_applies_silu_and_mul_bit_for_bit(rows: int, with_bias: bool, out_dtype: torch.dtype) -> None:
    weight, xq, x_scales, w_scales, bias, _ = _int8_case(rows, 128, 192, with_bias)
    # Scales that put some gates past expf's vector range.
    x_scales = x_scales * 50
    packed = cpu_native.pack_linear_amx_int8(weight)
    assert packed is not None
    product = cpu_native.linear_amx_int8(xq, x_scales, packed, w_scales, bias, out_dtype)
    assert product[:, :64].abs().max() > 87
    two_ops = cpu_native.silu_and_mul(product)
    fused = cpu_native.linear_amx_int8(xq, x_scales, packed, w_scales, bias, out_dtype, silu_mul=True)
    assert two_ops is not None and fused.shape == (rows, 64)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(fused.view(bits), two_ops.view(bits))


@amx
def test_silu_and_mul_needs_halves_of_whole_blocks() -> None:
    """A gate|up of 96 columns has halves of 48, which split a 32-column block: refused with a
    ValueError (silu_mul_fits says so first), never a wrong pairing of gate and up columns."""
    assert not cpu_native.silu_mul_fits(96) and cpu_native.silu_mul_fits(128)
    packed = cpu_native.pack_linear_amx(torch.randn(96, 64).to(torch.bfloat16))
    assert packed is not None
    with pytest.raises(ValueError, match="silu_mul_fits"):
        cpu_native.linear_amx(torch.randn(4, 64).to(torch.bfloat16), packed, None, 96, silu_mul=True)
