"""Triton kernel (b): paged attention for decode (one new token per sequence).

One program handles one (sequence, KV head, context partition): it loads the query heads of
that KV head's GQA group once, walks the block table a tile of tokens at a time, gathers K/V by
slot and keeps an online softmax in float32. Each K/V byte is read once per step, which is what
makes decode memory-bound rather than compute-bound.

Few sequences with long contexts would leave most of a GPU idle, so the context is split into
partitions (flash-decoding): each writes an unnormalized partial output with its running max
and sum, and a second small kernel merges them. With one partition the first kernel writes the
final output directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from kvscale.kernels.fp8 import refuse_fp8

_LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    positions,
    valid,
    kv_head,
    dims,
    dim_mask,
    cache_stride_slot,
    cache_stride_head,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """K and V of one tile of a sequence's positions, found through its block table row."""
    block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slots = block_ids * BLOCK_SIZE + positions % BLOCK_SIZE
    kv_offsets = slots[:, None] * cache_stride_slot + kv_head * cache_stride_head + dims[None, :]
    kv_mask = valid[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    return k, v


@triton.jit
def _decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    query_stride_seq,
    query_stride_head,
    block_tables_stride,
    cache_stride_slot,
    cache_stride_head,
    out_stride_seq,
    out_stride_head,
    num_partitions,
    partition_size,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # partition_size is a runtime argument: as a constexpr it would recompile the kernel every
    # time the block table grows by a block.
    part_start = part * partition_size
    part_end = tl.minimum(part_start + partition_size, context_len)

    group = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    head_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq * query_stride_seq + heads[:, None] * query_stride_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for tile_start in range(part_start, part_end, BLOCK_N):
        positions = tile_start + offsets
        valid = positions < part_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * block_tables_stride, positions,
            valid, kv_head, dims, dim_mask, cache_stride_slot, cache_stride_head,
            BLOCK_SIZE, DOT_DTYPE,
        )

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION
        )
        running_max = new_max

    if SINGLE_PARTITION:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(
            out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dim_mask[None, :],
        )
    else:
        # Partials are laid out [num_seqs, num_heads, num_partitions, (BLOCK_D)], contiguous.
        num_heads = tl.num_programs(1) * GROUP
        row = (seq * num_heads + heads) * num_partitions + part
        tl.store(part_max_ptr + row, running_max, mask=head_mask)
        tl.store(part_sum_ptr + row, running_sum, mask=head_mask)
        tl.store(
            part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :],
            acc,
            mask=head_mask[:, None] & dim_mask[None, :],
        )


@triton.jit
def _merge_partitions_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_stride_seq,
    out_stride_head,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    parts = tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_D)
    part_mask = parts < num_partitions
    rows = (seq * num_heads + head) * num_partitions + parts
    # Partitions past the context hold max -inf and sum 0, so they weigh nothing.
    maxes = tl.load(part_max_ptr + rows, mask=part_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + rows, mask=part_mask, other=0.0)
    accs = tl.load(
        part_acc_ptr + rows[:, None] * BLOCK_D + dims[None, :],
        mask=part_mask[:, None],
        other=0.0,
    )
    overall_max = tl.max(maxes, axis=0)
    # A sequence with an empty context (batch padding) has no finite max: its output is 0,
    # as in the reference, instead of exp2(-inf - -inf) = NaN.
    weights = tl.where(maxes > float("-inf"), tl.exp2(maxes - overall_max), 0.0)
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(accs * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * out_stride_seq + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partition_size: int | None = None,
) -> Tensor:
    """:class:`kvscale.kernels.ops.DecodeAttention` in Triton.

    ``partition_size`` (tokens, a multiple of the tile) overrides the split of long contexts;
    by default the context is split only when too few (sequence, KV head) pairs would keep
    the GPU's multiprocessors busy.

    The cache is in the model's dtype (the scales, which only an FP8 cache has, are not used).
    """
    refuse_fp8(k_cache, "Triton")
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_head_dim != head_dim:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match query {tuple(query.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if query.is_cuda else 16
    # Bound the context by the block table's width rather than reading context_lens back:
    # no host sync, and the launch shape depends only on tensor shapes.
    max_context = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = _default_partition_size(query, num_seqs * num_kv_heads, max_context)
    partition_size = max(block_n, -(-partition_size // block_n) * block_n)
    num_partitions = max(1, -(-max_context // partition_size))
    single = num_partitions == 1
    if single:
        part_acc = part_max = part_sum = out  # unused by the kernel in this mode
    else:
        part_max = torch.empty(
            (num_seqs, num_heads, num_partitions), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (num_seqs, num_heads, num_partitions, block_d), dtype=torch.float32,
            device=query.device,
        )
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        num_kv_heads * head_dim,
        head_dim,
        out.stride(0),
        out.stride(1),
        num_partitions,
        partition_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **dot_options(_decode_kernel, k_cache.dtype),
        SINGLE_PARTITION=single,
    )
    if not single:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            out.stride(0),
            out.stride(1),
            num_partitions,
            HEAD_DIM=head_dim,
            BLOCK_P=triton.next_power_of_2(num_partitions),
            BLOCK_D=block_d,
        )
    return out


def _default_partition_size(query: Tensor, num_programs: int, max_context: int) -> int:
    if not query.is_cuda:
        return 32  # interpreter: small partitions so that tests exercise the merge
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    if num_programs >= 2 * sms:
        return max_context
    # Enough partitions for ~2 programs per SM, but none shorter than 256 tokens.
    wanted = -(-2 * sms // num_programs)
    return max(256, -(-max_context // wanted))


def dot_options(kernel, cache_dtype: torch.dtype) -> dict:
    """The dtype and precision of a kernel's ``tl.dot`` operands for a cache dtype.

    float32 uses IEEE dots so that results match the reference to the last bits (TF32 would
    not). Triton's interpreter computes bfloat16 dots wrongly, so there the bfloat16 operands
    are widened to float32; loads, conversions and stores still run in bfloat16.
    """
    interpreted = isinstance(kernel, InterpretedFunction)
    if cache_dtype == torch.float32 or (interpreted and cache_dtype == torch.bfloat16):
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
    return {"DOT_DTYPE": _TL_DTYPES[cache_dtype], "DOT_PRECISION": "tf32"}


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


__all__ = ["paged_decode_attention"]
