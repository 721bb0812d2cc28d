"""PyTorch reference implementations of the paged-KV ops (:mod:`kvscale.kernels.ops`).

They define the semantics the Triton and C kernels must match, and they are the engine's CPU
path where no C kernel applies, so they avoid per-token Python work: K/V are gathered through the
block table a whole block at a time with one ``index_select`` per cache and attended to with
SDPA or two small GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvscale.kernels import fp8
from kvscale.kernels.ops import DecodeAttention, KernelBackend

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "REFERENCE"]


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    *, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """:class:`kvscale.kernels.ops.WriteKV` with one ``index_copy_`` per cache."""
    check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    # A view, not a copy: the cache must be contiguous so that in-place writes land in it.
    k_flat = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    v_flat = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    if fp8.is_fp8(k_cache.dtype):
        # index_copy_ has no FP8 kernel on CPU: the bytes are copied as bytes.
        k_flat.view(torch.uint8).index_copy_(0, slots, fp8.quantize(key, k_cache.dtype, k_scale).view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slots, fp8.quantize(value, v_cache.dtype, v_scale).view(torch.uint8))
        return
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def widened(cached: Tensor, scale: float) -> Tensor:
    """Cached K or V in float32: an FP8 cache's values times its scale, any other as it is."""
    return fp8.dequantize(cached, scale) if fp8.is_fp8(cached.dtype) else cached.float()


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
    """:class:`kvscale.kernels.ops.DecodeAttention`, one sequence at a time."""
    check_cache(k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    check_heads(num_heads, k_cache.shape[2])
    if num_seqs == 0:
        return query.new_empty(query.shape)
    lens = context_lens.tolist()
    if max(lens) == 0:  # only padding sequences (e.g. a padded CUDA-graph batch): zeros
        return torch.zeros_like(query)
    # Per sequence: gather only the blocks it uses (one index_select per cache, a few hundred KB
    # that stay in cache for the reads that follow), then two small GEMMs and a softmax. With a
    # handful of query rows per KV head, SDPA's flash kernel costs more in per-call set-up than
    # the math, and gathering several sequences at once into a bigger buffer was slower too.
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    seq_blocks = [-(-n // block_size) for n in lens]
    check_table_width(max(lens), block_size, block_tables)
    table = block_tables.to(device=k_cache.device, dtype=torch.long)
    k_blocks = k_cache.view(k_cache.shape[0], -1)
    v_blocks = v_cache.view(v_cache.shape[0], -1)
    rows = (-1, num_kv_heads, head_dim)
    # GQA without expanding K/V: the heads sharing a KV head become that head's query rows.
    group = num_heads // num_kv_heads
    grouped = query.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    out = torch.zeros(num_seqs, num_kv_heads, group, head_dim, dtype=torch.float32, device=query.device)
    for i, n in enumerate(lens):
        if not n:
            continue
        blocks = table[i, : seq_blocks[i]]
        k = widened(k_blocks.index_select(0, blocks).view(rows)[:n], k_scale).transpose(0, 1)  # [Hkv, n, D]
        v = widened(v_blocks.index_select(0, blocks).view(rows)[:n], v_scale).transpose(0, 1)
        scores = torch.matmul(grouped[i], k.transpose(1, 2)).mul_(scale)
        out[i] = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


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
    decode: DecodeAttention | None = None,
) -> Tensor:
    """:class:`kvscale.kernels.ops.PrefillAttention`, sequences of equal shape batched.

    Single-token sequences go through ``decode`` (default: :func:`paged_decode_attention`) in
    one batched call. ``max_query_len`` is not needed here: the lengths are read on the host.
    """
    check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    check_heads(num_heads, k_cache.shape[2])
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    if len(starts) != len(lens) + 1 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc {starts} does not describe {num_tokens} tokens of {len(lens)} seqs"
        )
    out = query.new_empty(query.shape)
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    for i, (q_len, ctx) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len > ctx:
            raise ValueError(f"sequence {i}: {q_len} new tokens but only {ctx} in context")

    # Single-token sequences (decodes inside a mixed batch) go through one batched decode call.
    single = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if single:
        idx = torch.tensor(single, device=query.device)
        token_idx = torch.tensor([starts[i] for i in single], device=query.device)
        out[token_idx] = (decode or paged_decode_attention)(
            query[token_idx], k_cache, v_cache, block_tables[idx], context_lens[idx], scale,
            k_scale=k_scale, v_scale=v_scale,
        )
    # Sequences with the same (new tokens, context) — chunks after a shared prefix, equal prompts —
    # attend in one batched call: one gather and one SDPA instead of one each per sequence.
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (q_len, ctx) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len > 1:
            groups.setdefault((q_len, ctx), []).append(i)
    for (q_len, ctx), members in groups.items():
        tables = block_tables[torch.tensor(members, device=block_tables.device)]
        keys, values = _gather_kv(k_cache, v_cache, tables, ctx)  # [S, ctx, Hkv, D]
        if fp8.is_fp8(keys.dtype):
            # In the query's dtype, as the C prefill kernel packs them (bfloat16 for AMX).
            keys = fp8.dequantize(keys, k_scale).to(query.dtype)
            values = fp8.dequantize(values, v_scale).to(query.dtype)
        rows: slice | Tensor
        if len(members) == 1:
            rows = slice(starts[members[0]], starts[members[0] + 1])
            q = query[rows][None]
        else:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members]).to(query.device)
            q = query.index_select(0, rows).view(len(members), q_len, num_heads, head_dim)
        q = q.transpose(1, 2)  # [S, H, q_len, D]
        if q_len == ctx:  # whole prompts: plain causal attention, no mask to build or read
            seq_out = _attend(q, keys, values, None, scale, causal=True)
        else:
            # Query j sits at position ctx - q_len + j and sees keys up to and including it.
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
            k_pos = torch.arange(ctx, device=query.device)
            mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, q_len, ctx]
            seq_out = _attend(q, keys, values, mask, scale)  # [S, H, q_len, D]
        flat = seq_out.transpose(1, 2).reshape(-1, num_heads, head_dim).to(query.dtype)
        if isinstance(rows, slice):
            out[rows] = flat
        else:
            out.index_copy_(0, rows, flat)
    return out


def check_table_width(context_len: int, block_size: int, block_tables: Tensor) -> int:
    """The blocks a context of ``context_len`` tokens uses; a ValueError if its table row is shorter."""
    num_blocks = -(-context_len // block_size)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(
            f"a context of {context_len} tokens needs {num_blocks} blocks, more blocks than its block table "
            f"row holds ({block_tables.shape[1]})"
        )
    return num_blocks


def _gather_kv(
    k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, max_len: int
) -> tuple[Tensor, Tensor]:
    """Gather the ``max_len`` tokens of each sequence (all of that length): ``[num_seqs, max_len, Hkv, D]``."""
    block_size = k_cache.shape[1]
    num_blocks = check_table_width(max_len, block_size, block_tables)
    # Every sequence here has max_len tokens, so every entry read is a used one: one outside the
    # cache is refused (the C kernels refuse it too), never clamped into another sequence's block.
    table = block_tables[:, :num_blocks].to(device=k_cache.device, dtype=torch.long)
    if bool(((table < 0) | (table >= k_cache.shape[0])).any()):
        raise ValueError(f"a used entry of the block table is not a block of the {k_cache.shape[0]}-block cache")
    num_seqs = table.shape[0]
    flat = table.reshape(-1)
    shape = (num_seqs, num_blocks * block_size, k_cache.shape[2], k_cache.shape[3])
    # Rows of whole blocks: a 2-D index_select copies at memcpy speed, a 4-D one does not.
    keys = k_cache.view(k_cache.shape[0], -1).index_select(0, flat).view(shape)[:, :max_len]
    values = v_cache.view(v_cache.shape[0], -1).index_select(0, flat).view(shape)[:, :max_len]
    return keys, values


def _attend(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, causal: bool = False
) -> Tensor:
    """SDPA with GQA; ``q`` ``[S, H, L, D]``, ``keys`` ``[S, T, Hkv, D]``.

    Scores and softmax are float32 either way: float32 inputs directly, bfloat16 ones inside
    SDPA's CPU kernel (which accumulates in float32 and runs its GEMMs on AMX/AVX-512 BF16, 2-4x
    faster than widening the inputs first); other dtypes are widened to float32.
    """
    compute = torch.bfloat16 if q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16 else torch.float32
    k = keys.transpose(1, 2).to(compute)
    v = values.transpose(1, 2).to(compute)
    return F.scaled_dot_product_attention(
        q.to(compute), k, v, attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def check_cache(k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def check_write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key/value must be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


REFERENCE = KernelBackend(
    "reference",
    write_kv=write_kv,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
    prefill_batches_decodes=True,
)
