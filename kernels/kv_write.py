"""Triton kernel (a): store each new token's K and V into its cache slot.

One program per token copies all its KV heads; a slot of -1 masks the whole store, so
tokens whose KV is already cached (prefix hits) cost only a load of their slot number.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kvscale.kernels.fp8 import refuse_fp8


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_slot,
    cache_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # The skip flag is broadcast to a tensor first: Triton's interpreter rejects a mask
    # combined from a scalar and a tensor.
    keep = (tl.zeros([BLOCK_H], dtype=tl.int64) + slot) >= 0
    mask = (keep & (heads < NUM_KV_HEADS))[:, None] & (dims[None, :] < HEAD_DIM)
    key = tl.load(
        key_ptr + token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * value_stride_token + heads[:, None] * value_stride_head
        + dims[None, :],
        mask=mask,
    )
    dest = slot * cache_stride_slot + heads[:, None] * cache_stride_head + dims[None, :]
    tl.store(k_cache_ptr + dest, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    *, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """:class:`kvscale.kernels.ops.WriteKV`, one program per token (a cache in the model's dtype:
    the scales, which only an FP8 cache has, are not used)."""
    refuse_fp8(k_cache, "Triton")
    num_tokens, num_kv_heads, head_dim = key.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache {tuple(k_cache.shape)} does not hold K/V of shape {tuple(key.shape)}"
        )
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError("value and slot_mapping must match key's tokens")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    if num_tokens == 0:
        return
    # Per-token and per-head strides are honoured (K/V may be views of a fused QKV output);
    # the head dimension itself must be dense.
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads * head_dim,
        head_dim,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


__all__ = ["write_kv"]
