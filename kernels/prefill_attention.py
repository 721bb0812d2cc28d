"""Triton kernel (c): causal attention of a ragged batch of new tokens over paged KV.

Covers a whole prompt, a chunk after a cached prefix (chunked prefill, prefix-cache hits) and
single decode tokens in a mixed batch: the new tokens of a sequence are the last ``q_len`` of
its ``context_len`` cached tokens, and the query at position p sees keys 0..p.

One program handles a tile of one sequence's query tokens for one query head (GQA maps it to
its KV head). It walks the sequence's keys through the block table only up to its tile's last
position, so the causal upper triangle is never loaded, with an online softmax in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvscale.kernels.decode_attention import _LOG2E, dot_options, load_kv_tile
from kvscale.kernels.fp8 import refuse_fp8


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    query_stride_token,
    query_stride_head,
    block_tables_stride,
    cache_stride_slot,
    cache_stride_head,
    out_stride_token,
    out_stride_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_positions = context_len - q_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + (q_start + rows[:, None]) * query_stride_token + head * query_stride_head
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    # Keys this tile can see end at its last real query's position; a tile past q_len sees none.
    last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)
    kv_end = tl.where(tile * BLOCK_M < q_len, context_len - q_len + last_row, 0)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for tile_start in range(0, kv_end, BLOCK_N):
        positions = tile_start + offsets
        valid = positions < kv_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * block_tables_stride, positions,
            valid, kv_head, dims, dim_mask, cache_stride_slot, cache_stride_head,
            BLOCK_SIZE, DOT_DTYPE,
        )

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = valid[None, :] & (positions[None, :] <= q_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is in the first tile and visible to every row, so running_max is finite from
        # then on and fully masked later tiles contribute exp2(-inf) = 0.
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION
        )
        running_max = new_max

    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows[:, None]) * out_stride_token + head * out_stride_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """:class:`kvscale.kernels.ops.PrefillAttention` in Triton.

    ``max_query_len`` sizes the launch grid; without it it is read back from
    ``query_start_loc`` (a device sync).

    The cache is in the model's dtype (the scales, which only an FP8 cache has, are not used).
    """
    refuse_fp8(k_cache, "Triton")
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_head_dim != head_dim:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match query {tuple(query.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}]")
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # Interpreter (tests): small tiles, so that short test sequences still span several tiles.
    block_m, block_n = (64, 64) if query.is_cuda else (16, 16)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        num_kv_heads * head_dim,
        head_dim,
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        **dot_options(_prefill_kernel, k_cache.dtype),
    )
    return out


__all__ = ["paged_prefill_attention"]
