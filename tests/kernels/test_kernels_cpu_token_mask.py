"""The token bitmask applied in C (cpu_token_mask.c) against the grammar manager's PyTorch path."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels import cpu_native
from kvscale.server.structured_outputs.manager import _apply_unpacked, unpack

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("vocab", "words"), [(49152, 1536), (1000, 32), (1030, 32)],
                         ids=["whole-words", "ragged-vocab", "vocab-past-the-bits"])
def test_the_c_mask_is_the_pytorch_mask(dtype: torch.dtype, vocab: int, words: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    rows = [0, 2, 5]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int32)
    bitmask[1] = -1  # a row where every known token is allowed
    bitmask[2, : words // 2] = 0  # and one where the first half is not
    expected = logits.clone()
    _apply_unpacked(expected, rows, unpack(bitmask))
    assert cpu_native.apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)
    # The rows without a grammar were left as they were, and masked tokens are -inf, not NaN.
    assert torch.isfinite(logits[[1, 3, 4]]).all()
    assert not torch.isnan(logits).any()
    assert (logits[rows] == float("-inf")).any()


def test_what_the_kernel_does_not_take_is_left_untouched() -> None:
    logits = torch.randn(2, 64, dtype=torch.float16)
    assert not cpu_native.apply_token_bitmask(logits, [0], torch.zeros((1, 2), dtype=torch.int32))
    assert not cpu_native.apply_token_bitmask(torch.randn(2, 64), [0], torch.zeros((1, 2), dtype=torch.int64))
