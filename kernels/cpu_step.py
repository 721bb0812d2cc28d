"""A batched step's decoder layers in one C call (cpu_step_layers.c): the structures the kernel
reads, as ctypes lays them out, and the call that runs them."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kvscale.kernels.cpu_build import library

_PTR, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Projection(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_projection``: one projection as the AMX kernel holds it
    (bfloat16 where ``w_scales`` is NULL, else int8)."""

    _fields_ = [("packed", _PTR), ("column_sums", _PTR), ("w_scales", _PTR), ("bias", _PTR),
                ("out_features", _I64), ("in_features", _I64)]


class DecoderLayer(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_decoder_layer``."""

    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", Projection), ("o", Projection),
                ("gate_up", Projection), ("down", Projection), ("k_cache", _PTR), ("v_cache", _PTR),
                ("k_scale", _F32), ("v_scale", _F32)]


class StepAttention(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_step_attention``: a decode step's tables and lengths (one
    sequence a row, ``query_start_loc`` NULL), or a step with prompt chunks and its single-token
    sequences apart."""

    _fields_ = [("block_tables", _PTR), ("table_stride", _I64), ("context_lens", _PTR), ("query_start_loc", _PTR),
                ("num_seqs", _I64), ("single_rows", _PTR), ("single_tables", _PTR), ("single_lens", _PTR),
                ("num_single", _I64)]


class DecoderShape(ctypes.Structure):
    """cpu_step_layers.c's ``kvscale_decoder_shape``."""

    _fields_ = [("hidden", _I64), ("intermediate", _I64), ("num_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("eps", _F32), ("scale", _F32),
                ("cache_format", ctypes.c_int32), ("block_size", ctypes.c_int32), ("num_blocks", _I64)]


def step_layers(layers: ctypes.Array, shape: DecoderShape, hidden: Tensor, residual: Tensor, positions: Tensor,
                  cos_table: Tensor, sin_table: Tensor, slots: Tensor, attention: StepAttention,
                  residual_ready: bool = False) -> None:
    """Every decoder layer of a step in one call (cpu_step_layers.c): ``hidden`` ``[rows,
    hidden]`` bfloat16 holds the embeddings and is left holding the last layer's MLP output,
    ``residual`` (same shape) the residual stream. Or a run of them: with ``residual_ready``,
    ``hidden`` and ``residual`` are what the layers before ``layers`` left. The caller checked
    that each kernel applies and keeps the tensors ``attention`` points into alive
    (server/worker/cpu_step_layers.py); positions and slots are int64, contiguous."""
    lib = library()
    assert lib is not None  # the AMX projections it chains needed it
    status = lib.kvscale_step_layers(
        ctypes.byref(layers), len(layers), int(residual_ready), ctypes.byref(shape), hidden.data_ptr(),
        residual.data_ptr(), hidden.shape[0], positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(), cos_table.stride(0),
        slots.data_ptr(), ctypes.byref(attention), torch.get_num_threads())
    if status == 1:
        raise MemoryError("the step's layers could not allocate their buffers")
    if status == 2:
        raise RuntimeError("an AMX projection refused the step's rows")
    if status == 3:
        raise ValueError(f"a slot in slot_mapping is outside the {shape.num_blocks * shape.block_size}-slot cache")
    if status == 4:
        raise ValueError(
            "a sequence has more new tokens than context, or needs more blocks than its block table row "
            f"holds, or a used entry is not a block of the {shape.num_blocks}-block cache"
        )
