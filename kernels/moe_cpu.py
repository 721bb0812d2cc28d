"""A mixture-of-experts block's experts in one C call on CPUs (``cpu_moe.c``): every (row,
expert) pair of a batch through its expert's gated MLP and scaled by its routing weight, each
expert's stacked matrices read once for all its rows (server/worker/moe.py says where it runs).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvscale.kernels.cpu_build import library

DTYPES = (torch.float32, torch.bfloat16)
_NO_MEMORY = 2  # cpu_moe.c's KVSCALE_MOE_NO_MEMORY


@functools.cache
def native_available() -> bool:
    """Whether the C kernels run in this process (cpu_build.library)."""
    return library() is not None


def moe_experts(x: Tensor, sorted_rows: Tensor, weights: Tensor, dest: Tensor, counts: Tensor, w13: Tensor,
                w2: Tensor) -> Tensor:
    """``y[dest[p]] = expert_e(x[sorted_rows[p]]) * weights[p]`` for the pairs ``p`` sorted by
    expert (``counts[e]`` of them expert e's), in ``x``'s dtype: ``x`` [rows, hidden] with a unit
    column stride, ``w13`` [experts, 2 * inter, hidden] (gate, then up) and ``w2`` [experts,
    hidden, inter] contiguous in ``x``'s dtype, ``sorted_rows``, ``dest`` and ``counts`` int64,
    ``weights`` float32."""
    experts, two_inter, hidden = w13.shape
    assert x.dtype == w13.dtype == w2.dtype and x.dtype in DTYPES and x.stride(1) == 1
    assert w13.is_contiguous() and w2.is_contiguous() and tuple(w2.shape) == (experts, hidden, two_inter // 2)
    assert sorted_rows.dtype == dest.dtype == counts.dtype == torch.int64 and weights.dtype == torch.float32
    assert sorted_rows.is_contiguous() and dest.is_contiguous() and counts.is_contiguous() and weights.is_contiguous()
    lib = library()
    assert lib is not None  # native_available() said so
    pairs = sorted_rows.shape[0]
    y = x.new_empty(pairs, hidden)
    status = lib.kvscale_moe_experts(
        x.data_ptr(), x.stride(0), sorted_rows.data_ptr(), weights.data_ptr(), dest.data_ptr(), pairs,
        counts.data_ptr(), experts, w13.data_ptr(), w2.data_ptr(), hidden, two_inter // 2, y.data_ptr(),
        int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if status == _NO_MEMORY:
        raise MemoryError("the experts kernel could not allocate its scratch")
    return y


__all__ = ["DTYPES", "moe_experts", "native_available"]
