"""The C KV write (cpu_write_kv.c) against the reference's index_copy_."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import check_write_kv

from kvscale.kernels import cpu_native, reference

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_writes_match_the_reference_bit_for_bit(seed: int, dtype: torch.dtype) -> None:
    result = check_write_kv(cpu_native.CPU, torch.Generator().manual_seed(seed), dtype, "cpu")
    assert result["max_error"] == 0.0


def test_k_and_v_may_be_views_into_the_fused_qkv_rows() -> None:
    # The model passes v as a view of the qkv output and k from the rotated q|k rows.
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(10, 9 + 3 + 3, 64, generator=gen).to(torch.bfloat16)
    key, value = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([5, -1, 0, 31, 7, 8, -1, 20, 21, 2])
    caches = [torch.zeros(4, 8, 3, 64, dtype=torch.bfloat16) for _ in range(4)]
    cpu_native.write_kv(key, value, caches[0], caches[1], slots)
    reference.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(32, 3, 64)[5].equal(key[0])


def test_a_slot_outside_the_cache_raises_and_writes_nothing() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    key = value = torch.ones(2, 1, 16)
    with pytest.raises(ValueError, match="outside the 8-slot cache"):
        cpu_native.write_kv(key, value, k_cache, v_cache, torch.tensor([1, 8]))
    assert not k_cache.any() and not v_cache.any()
