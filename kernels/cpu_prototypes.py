"""The C kernels' prototypes as ctypes sees them, (result, arguments) for each exported function:
set on the library once it is loaded (cpu_build.py). The one place the Python side writes them;
the argument names in the comments are the C sources'."""

from __future__ import annotations

import ctypes

_PTR, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
C_PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    "kvscale_paged_decode_attention": (ctypes.c_int, [
        _PTR, _PTR, _PTR, _I32, _I32,  # query, k_cache, v_cache, cache_format, query_is_bf16
        _I64, _PTR, _I64, _PTR,  # num_blocks, block_tables, table_stride, context_lens
        _I32, _I32, _I32, _I32, _I32,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
        _F32, _F32, _F32, _PTR, _I32, _I32,  # scale, k_scale, v_scale, out, io_bf16, num_threads
    ]),
    # cache_format, query_is_bf16, block_size, num_heads, num_kv_heads, head_dim
    "kvscale_decode_attention_on_amx": (ctypes.c_int, [_I32, _I32, _I32, _I32, _I32, _I32]),
    "kvscale_paged_prefill_attention": (ctypes.c_int, [
        _PTR, _I64, _PTR, _PTR, _I64,  # query, query_stride, k_cache, v_cache, num_blocks
        _PTR, _I64, _PTR, _PTR,  # block_tables, table_stride, query_start_loc, context_lens
        _I32, _I32, _I32, _I32, _I32,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
        _I32, _F32, _F32, _F32, _PTR, _I32,  # cache_format, k_scale, v_scale, scale, out, num_threads
    ]),
    "kvscale_prefill_attention_available": (ctypes.c_int, []),
    "kvscale_paged_prefill_attention_f32": (ctypes.c_int, [
        _PTR, _I64, _PTR, _PTR, _I64,  # query, query_stride, k_cache, v_cache, num_blocks
        _PTR, _I64, _PTR, _PTR,  # block_tables, table_stride, query_start_loc, context_lens
        _I32, _I32, _I32, _I32, _I32,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
        _F32, _PTR, _I32,  # scale, out, num_threads
    ]),
    "kvscale_prefill_attention_f32_available": (ctypes.c_int, []),
    # x, rows, x_stride, w, int8_codes, n_out, k_in, out, num_threads
    "kvscale_linear_narrow": (ctypes.c_int, [_PTR, _I64, _I64, _PTR, _I32, _I64, _I64, _PTR, _I32]),
    "kvscale_linear_narrow_available": (ctypes.c_int, []),
    # x, x_stride, out, out_stride, sorted_rows, num_sorted, tiles, num_tiles, slot_table, num_slots,
    # slices, num_slices, in, is_bf16, num_threads
    "kvscale_lora_sgmv": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I32,
                                         _I64, _I32, _I32]),
    # x, x_stride, topk_ids, topk_weights, rows, k, num_experts, w13, w2, hidden, inter, out, is_bf16,
    # num_threads
    "kvscale_moe_block": (ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR,
                                         _I32, _I32]),
    # key, key_stride, value, value_stride, k_cache, v_cache, num_slots, slots, num_tokens, row, elem
    "kvscale_write_kv": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64]),
    # key, key_stride, value, value_stride, k_cache, v_cache, num_slots, slots, num_tokens, row, is_bf16,
    # format, k_scale, v_scale
    "kvscale_write_kv_fp8": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I32, _I32,
                                            _F32, _F32]),
    # gate_up, out, rows, width, is_bf16, num_threads
    "kvscale_silu_and_mul": (None, [_PTR, _PTR, _I64, _I64, _I32, _I32]),
    # x, residual, weight, out, rows, width, eps, is_bf16, num_threads
    "kvscale_add_rms_norm": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _I32, _I32]),
    # x, row_stride, positions, cos_table, sin_table, table_stride, out, tokens, heads, head_dim,
    # is_bf16, num_threads
    "kvscale_rope": (None, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I32, _I32]),
    # x, rows, width, is_bf16, q, scales, num_threads
    "kvscale_quantize_rows_u8": (None, [_PTR, _I64, _I64, _I32, _PTR, _PTR, _I32]),
    # y, y_bf16, scales, bias, rows, width, out, out_bf16, num_threads
    "kvscale_rescale_rows": (None, [_PTR, _I32, _PTR, _PTR, _I64, _I64, _PTR, _I32, _I32]),
    "kvscale_linear_dot_available": (ctypes.c_int, []),
    # weight, n, k, packed
    "kvscale_linear_dot_pack": (None, [_PTR, _I64, _I64, _PTR]),
    # x, x_stride, packed, bias, m, n, k, out, silu_mul, num_threads
    "kvscale_linear_dot": (ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I32, _I32]),
    "kvscale_linear_amx_available": (ctypes.c_int, []),
    # weight, n, k, packed
    "kvscale_linear_amx_pack": (None, [_PTR, _I64, _I64, _PTR]),
    # x, x_stride, packed, bias, m, n, k, out, silu_mul, num_threads
    "kvscale_linear_amx": (ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I32, _I32]),
    # weight, n, k, packed, column_sums
    "kvscale_linear_amx_int8_pack": (None, [_PTR, _I64, _I64, _PTR, _PTR]),
    # x, x_scales, packed, column_sums, w_scales, bias, m, n, k, out, out_bf16, silu_mul, num_threads
    "kvscale_linear_amx_int8": (ctypes.c_int, [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I32, _I32,
                                               _I32]),
    # logits, row_stride, is_bf16, rows, num_rows, bitmask, words, vocab, num_threads
    "kvscale_apply_token_bitmask": (None, [_PTR, _I64, _I32, _PTR, _I64, _PTR, _I64, _I64, _I32]),
    # cpus, num_threads
    "kvscale_bind_threads": (ctypes.c_int, [_PTR, _I32]),
    # layers, num_layers, residual_ready, shape, hidden, residual, rows, positions, cos_table,
    # sin_table, cos_stride, slots, attention, num_threads
    "kvscale_step_layers": (ctypes.c_int, [_PTR, _I32, _I32, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                                             _PTR, _PTR, _I32]),
}
