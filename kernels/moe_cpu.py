"""A mixture-of-experts block's experts in one C call on CPUs (``cpu_moe.c``): every (row,
expert) pair of a batch through its expert's gated MLP, scaled by its routing weight, and each
row's pairs summed in ascending expert order (kernels/moe.py's contract), each expert's stacked
matrices read once for all its pairs (server/worker/moe.py says where it runs).
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


def moe_block(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The block's output ``[rows, hidden]`` in ``x``'s dtype: ``x`` [rows, hidden] with a unit
    column stride; ``topk_ids`` [rows, k] int64, each row's k distinct experts (below the
    experts' count: the kernel indexes with them unchecked), ``topk_weights`` [rows, k] (float32,
    or exactly representable in it); ``w13`` [experts, 2 * inter, hidden] (gate, then up) and
    ``w2`` [experts, hidden, inter] contiguous in ``x``'s dtype."""
    experts, two_inter, hidden = w13.shape
    rows, k = topk_ids.shape
    assert x.dtype == w13.dtype == w2.dtype and x.dtype in DTYPES and x.stride(1) == 1 and x.shape == (rows, hidden)
    assert w13.is_contiguous() and w2.is_contiguous() and tuple(w2.shape) == (experts, hidden, two_inter // 2)
    assert topk_ids.dtype == torch.int64 and topk_weights.shape == topk_ids.shape
    ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    lib = library()
    assert lib is not None  # native_available() said so
    out = x.new_empty(rows, hidden)
    status = lib.kvscale_moe_block(
        x.data_ptr(), x.stride(0), ids.data_ptr(), weights.data_ptr(), rows, k, experts, w13.data_ptr(),
        w2.data_ptr(), hidden, two_inter // 2, out.data_ptr(), int(x.dtype == torch.bfloat16),
        torch.get_num_threads())
    if status == _NO_MEMORY:
        raise MemoryError("the experts kernel could not allocate its scratch")
    return out


__all__ = ["DTYPES", "moe_block", "native_available"]
