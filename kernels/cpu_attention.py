"""Paged attention and KV writes in C, and the CPU kernel backend (``CPU``) built from them.

Decode attention reads the paged cache in place for every sequence of a layer in one call
(cpu_decode_attention.c; the PyTorch reference's per-sequence ops were most of a decode step's
non-GEMM time), on AMX tiles for a bfloat16 or FP8 cache where the CPU has them. Prefill attention
runs every multi-token sequence of a layer in one call: bfloat16 on AMX tiles
(cpu_prefill_attention.c), float32 on AVX2 and FMA (cpu_prefill_attention_f32.c). KV writes copy
(or quantize) each new token's rows into their cache slots (cpu_write_kv.c). Each falls back to
the PyTorch reference where its kernel does not apply."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvscale.kernels import fp8, reference
from kvscale.kernels.cpu_build import library
from kvscale.kernels.ops import KernelBackend

# KVSCALE_BAD_TABLE in cpu_decode_attention.c, KVSCALE_PREFILL_BAD_TABLE and KVSCALE_PREFILL_F32_BAD_TABLE in
# the prefill kernels.
_BAD_TABLE = 2


def _check_paged(query: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """What the C attention kernels assume of a query and the paged caches they read in place."""
    reference.check_cache(k_cache, v_cache)
    reference.check_heads(query.shape[1], k_cache.shape[2])
    if k_cache.shape[3] != query.shape[2]:
        raise ValueError(f"query head_dim {query.shape[2]} does not match the cache's {k_cache.shape[3]}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


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
) -> Tensor:
    """:class:`kvscale.kernels.ops.DecodeAttention` in C, every sequence of a layer in one call;
    the reference where the C kernel does not apply (no compiler, another dtype or head size)."""
    lib = library()
    head_dim = query.shape[-1]
    cache_format = fp8.cache_format(k_cache.dtype)
    if lib is None or cache_format is None or query.is_cuda or head_dim % 16 or head_dim > 128:
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                                k_scale=k_scale, v_scale=v_scale)
    _check_paged(query, k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables must be [{num_seqs}, max_blocks] and context_lens [{num_seqs}], got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    # A bfloat16 query and output stay bfloat16 (the kernel widens and rounds each task's rows);
    # anything else goes through float32.
    io_bf16 = query.dtype == torch.bfloat16
    q = query.contiguous() if io_bf16 else query.to(torch.float32).contiguous()
    # The runner hands int32 tables and lengths already (every layer of a step reads the same).
    tables = _contiguous_as(block_tables, torch.int32)
    lens = _contiguous_as(context_lens, torch.int32)
    out = torch.empty_like(q)
    status = lib.kvscale_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_format,
        int(query.dtype == torch.bfloat16),
        num_blocks, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, k_scale, v_scale, out.data_ptr(),
        int(io_bf16), torch.get_num_threads(),
    )
    if status == _BAD_TABLE:
        raise ValueError(
            "a context needs more blocks than its block table row holds, or a used entry is not a "
            f"block of the {num_blocks}-block cache"
        )
    if status:
        raise MemoryError("decode attention could not allocate its score buffers")
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _contiguous_as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as a contiguous tensor of ``dtype``, itself where it is one already."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def decode_attention_on_amx(cache_dtype: torch.dtype, query_dtype: torch.dtype, block_size: int, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`paged_decode_attention` runs these shapes on AMX tiles here: a bfloat16 or
    FP8 cache with a bfloat16 query, blocks of whole 16-key tiles, heads of 64 or 128 dims, GQA
    groups up to 16, on a build with AMX and the OS's leave to use it. Elsewhere the C kernel's AVX-512 (or plain) loops serve them."""
    lib = library()
    cache_format = fp8.cache_format(cache_dtype)
    return lib is not None and cache_format is not None and bool(lib.kvscale_decode_attention_on_amx(
        cache_format, int(query_dtype == torch.bfloat16), block_size, num_heads, num_kv_heads, head_dim))


@functools.cache
def amx_prefill_available() -> bool:
    """Whether bfloat16 prefill attention runs in C here: a build with AMX and the OS's leave to use it."""
    lib = library()
    return lib is not None and bool(lib.kvscale_prefill_attention_available())


@functools.cache
def f32_prefill_available() -> bool:
    """Whether float32 prefill attention runs in C here: a build with AVX2 and FMA."""
    lib = library()
    return lib is not None and bool(lib.kvscale_prefill_attention_f32_available())


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
    """:class:`kvscale.kernels.ops.PrefillAttention`: every multi-token sequence of a layer in one C
    call, and the single-token ones through the C decode kernel, where a kernel takes the dtypes:
    on CPUs with AMX a bfloat16 query with a bfloat16 or FP8 cache (cpu_prefill_attention.c), on
    CPUs with AVX2 and FMA a float32 query and cache (cpu_prefill_attention_f32.c); elsewhere the
    PyTorch reference (other dtypes and head sizes)."""
    num_tokens, num_heads, head_dim = query.shape
    layout_ok = query.device.type == "cpu" and query.stride(2) == 1 and query.stride(1) == head_dim
    f32 = (layout_ok and query.dtype == torch.float32 and k_cache.dtype == torch.float32
           and head_dim % 8 == 0 and head_dim <= 256 and f32_prefill_available())
    amx = (layout_ok and query.dtype == torch.bfloat16
           and (k_cache.dtype == torch.bfloat16 or fp8.is_fp8(k_cache.dtype))
           and head_dim % 32 == 0 and head_dim <= 256 and amx_prefill_available())
    if not (f32 or amx):
        return reference.paged_prefill_attention(
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, decode=paged_decode_attention,
            k_scale=k_scale, v_scale=v_scale,
        )
    _check_paged(query, k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    starts = query_start_loc.to(torch.int32).contiguous()
    if starts.shape != (num_seqs + 1,) or int(starts[0]) != 0 or int(starts[-1]) != num_tokens:
        raise ValueError(f"query_start_loc {starts.tolist()} does not describe {num_tokens} tokens of {num_seqs} seqs")
    lens = context_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    out = query.new_empty((num_tokens, num_heads, head_dim))
    lib = library()
    assert lib is not None  # f32_prefill_available() or amx_prefill_available() said so
    paged = (query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
             tables.data_ptr(), tables.shape[1], starts.data_ptr(), lens.data_ptr(),
             num_seqs, num_heads, num_kv_heads, head_dim, block_size)
    if f32:
        status = lib.kvscale_paged_prefill_attention_f32(*paged, scale, out.data_ptr(), torch.get_num_threads())
    else:
        status = lib.kvscale_paged_prefill_attention(*paged, fp8.cache_format(k_cache.dtype), k_scale, v_scale,
                                                     scale, out.data_ptr(), torch.get_num_threads())
    if status == _BAD_TABLE:
        raise ValueError(
            "a sequence has more new tokens than context, or needs more blocks than its block table "
            f"row holds, or a used entry is not a block of the {num_blocks}-block cache"
        )
    if status:
        raise MemoryError("prefill attention could not allocate its packed K/V")
    # Single-token sequences (decodes inside a mixed batch): the kernel left their rows to this.
    single = ((starts[1:] - starts[:-1]) == 1).nonzero().flatten()
    if single.numel():
        rows = starts[:-1].index_select(0, single).long()
        out[rows] = paged_decode_attention(
            query.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, single.to(block_tables.device)),
            context_lens.index_select(0, single.to(context_lens.device)), scale, k_scale=k_scale, v_scale=v_scale,
        )
    return out


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    *, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """:class:`kvscale.kernels.ops.WriteKV` in C (two row copies per token, or two rows quantized
    into an FP8 cache); the reference where the C kernels do not run or the rows need a cast or
    are not contiguous per token."""
    lib = library()
    # First, so that a malformed key gets its ValueError before any stride is read below.
    reference.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    quantized = fp8.is_fp8(k_cache.dtype)
    if (lib is None or k_cache.dtype != v_cache.dtype or key.dtype != value.dtype
            or (key.dtype not in (torch.float32, torch.bfloat16) if quantized else key.dtype != k_cache.dtype)
            or not key.is_cpu or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or not (_rows_contiguous(key) and _rows_contiguous(value))):
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    slots = _contiguous_as(slot_mapping, torch.int64)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if quantized:
        status = lib.kvscale_write_kv_fp8(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                          k_cache.data_ptr(), v_cache.data_ptr(), num_slots, slots.data_ptr(),
                                          key.shape[0], key.shape[1] * key.shape[2], int(key.dtype == torch.bfloat16),
                                          fp8.cache_format(k_cache.dtype), k_scale, v_scale)
    else:
        status = lib.kvscale_write_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                      k_cache.data_ptr(), v_cache.data_ptr(), num_slots, slots.data_ptr(),
                                      key.shape[0], key.shape[1] * key.shape[2], key.element_size())
    if status:
        raise ValueError(f"a slot in slot_mapping is outside the {num_slots}-slot cache")


def _rows_contiguous(t: Tensor) -> bool:
    """Whether each token's heads of ``t`` ``[tokens, heads, head_dim]`` lie contiguously."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


# The engine's CPU path: KV writes and decode attention in C (also for the decode tokens of
# mixed batches), prefill attention in C on AMX CPUs with a bfloat16 model and on AVX2 CPUs with a
# float32 one, the rest of prefill attention in PyTorch (one gather and one SDPA per group of
# equal sequences).
CPU = KernelBackend(
    "cpu",
    write_kv=write_kv,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
    prefill_batches_decodes=True,
)
