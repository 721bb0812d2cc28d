"""The narrow projection (cpu_linear_narrow.c): bfloat16 weights or int8 codes widened as they are
read, on a decode step's few float32 rows, against float64 products of the same values."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import cpu_has_avx2_fma

from kvscale.kernels import cpu_native

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")

avx2 = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="this CPU has no AVX2 and FMA")


def test_the_narrow_path_is_there_exactly_where_the_cpu_has_avx2_and_fma() -> None:
    assert cpu_native.narrow_linear_available() == cpu_has_avx2_fma()


def _weight(dtype: torch.dtype, out_features: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    return torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)


@avx2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (7, 37), (577, 1536)])
def test_the_narrow_projection_is_the_widened_product(dtype: torch.dtype, rows: int, out_features: int,
                                                      in_features: int) -> None:
    """Every row group size (4 and its tails), an odd last output channel, k past the last 8-wide
    chunk (37), and rows read as a column slice of wider ones."""
    gen = torch.Generator().manual_seed(rows * out_features)
    weight = _weight(dtype, out_features, in_features, gen)
    wide = torch.randn(rows, in_features + 24, generator=gen)
    x = wide[:, 8:8 + in_features]
    got = cpu_native.linear_narrow(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    expected = x.double() @ weight.double().t()
    # float32 sums of exact products, in another order: a few ulps of the row's scale.
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5


@avx2
def test_int8_codes_sum_to_the_integers_int_mm_forms() -> None:
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (130, 576), generator=gen, dtype=torch.int8)
    x = torch.randint(-127, 128, (6, 576), generator=gen, dtype=torch.int8)
    expected = torch._int_mm(x, codes.t().contiguous())
    assert torch.equal(cpu_native.linear_narrow(x.float(), codes), expected.float())
