"""The passes around an int8 projection (cpu_quantize.c) against the PyTorch reference of
server/worker/quantization.py."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels import cpu_native
from kvscale.server.worker.quantization import quantize_per_row

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (64, 1536), (300, 576), (5, 17)])
def test_quantize_rows_matches_the_reference(rows: int, width: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).mul(3).to(dtype)
    x[0, :] = 0.0  # an all-zero row: no division by zero, all codes at the zero point
    got = cpu_native.quantize_rows_u8(x)
    assert got is not None
    q, scales = got
    assert q.dtype == torch.uint8 and scales.dtype == torch.float32 and q.shape == (rows, width)
    expected_q, expected_scales = quantize_per_row(x)
    # Bit for bit: a code one step off on a rounding boundary moved the bundled model's int8
    # perplexity ratio by a percent (cpu_quantize.c says how).
    assert torch.equal(scales, expected_scales)
    signed = q.to(torch.int16) - 128
    assert torch.equal(signed, expected_q.to(torch.int16))
    assert torch.equal(q[0], torch.full((width,), 128, dtype=torch.uint8))
    assert int(signed.abs().max()) <= 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rescale_rows_matches_torch_in_place(dtype: torch.dtype, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    sums, scales = (torch.randn(70, 333, generator=gen) * 100).to(dtype), torch.rand(70, generator=gen)
    bias = torch.randn(333, generator=gen) if with_bias else None
    expected = (sums.float() * scales[:, None] + (bias if bias is not None else 0.0)).to(dtype)
    got = cpu_native.rescale_rows(sums, scales, bias)
    assert got is not None and got.dtype == dtype and got.data_ptr() == sums.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-4)


def test_what_the_kernels_do_not_take_falls_back() -> None:
    assert cpu_native.quantize_rows_u8(torch.randn(4, 8, dtype=torch.float16)) is None
    assert cpu_native.quantize_rows_u8(torch.randn(4, 8).t()) is None  # not contiguous
    assert cpu_native.rescale_rows(torch.randn(4, 8, dtype=torch.float16), torch.rand(4), None) is None
    assert cpu_native.rescale_rows(torch.randn(4, 8), torch.rand(4, dtype=torch.float64), None) is None
